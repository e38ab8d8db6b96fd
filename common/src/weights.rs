//! What the trainable weights are kept in (`[optimizer] weight_dtype`): the setting and its
//! bytes. Each runtime maps it to its Burn's dtype.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::fp16::Precision;

/// What the trainable weights are kept in (`[optimizer] weight_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WeightDtype {
    /// fp32 (Burn's and PyTorch's default).
    #[default]
    #[serde(rename = "fp32")]
    F32,
    /// bfloat16: fp32's range, 8 bits of mantissa. Half the bytes.
    #[serde(rename = "bf16")]
    Bf16,
    /// IEEE half: 11 bits of mantissa but a range of 6e-8 to 65504: updates below its spacing
    /// vanish (the run warns with the fraction measured).
    #[serde(rename = "f16")]
    F16,
}

impl WeightDtype {
    /// Bytes per weight.
    pub fn bytes(self) -> u64 {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 | WeightDtype::F16 => 2,
        }
    }

    /// The half precision of a 16-bit type (`None` for fp32).
    pub fn precision(self) -> Option<Precision> {
        match self {
            WeightDtype::F32 => None,
            WeightDtype::Bf16 => Some(Precision::Bf16),
            WeightDtype::F16 => Some(Precision::F16),
        }
    }

    /// Its name in configs and snapshots.
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "fp32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::F16 => "f16",
        }
    }
}

impl fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a 16-bit weight takes its fp32 update (`[optimizer] weight_rounding`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightRounding {
    /// To one of the two neighbours at random, the expected value being the fp32 result
    /// (seeded; the same draws after a resume).
    #[default]
    Stochastic,
    /// To the nearest (the plain cast): an update below half the spacing is lost.
    Nearest,
    /// To the nearest, the rounding error kept in a 16-bit compensation per weight and added
    /// to the next update (2 bytes a weight more).
    Kahan,
}

impl WeightRounding {
    /// Its name in configs and snapshots.
    pub fn name(self) -> &'static str {
        match self {
            WeightRounding::Stochastic => "stochastic",
            WeightRounding::Nearest => "nearest",
            WeightRounding::Kahan => "kahan",
        }
    }
}

impl fmt::Display for WeightRounding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the trainable weights are kept: the type, the rounding of each update, and the seed of
/// the stochastic rounding's draws.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightSpec {
    /// The weights' type.
    pub dtype: WeightDtype,
    /// The rounding of each update (16-bit types only).
    pub rounding: WeightRounding,
    /// The seed of the stochastic rounding's draws.
    pub seed: u64,
    /// How the frozen weights are held: as the trainable ones (`None`), or compressed further
    /// (memsave's `nn::frozen`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen: Option<FrozenDtype>,
}

impl WeightSpec {
    /// fp32 weights (nothing compressed).
    pub const FP32: WeightSpec = WeightSpec {
        dtype: WeightDtype::F32,
        rounding: WeightRounding::Stochastic,
        seed: 0,
        frozen: None,
    };

    /// Weights in `dtype`, updates rounded by `rounding`.
    pub fn new(dtype: WeightDtype, rounding: WeightRounding) -> Self {
        WeightSpec {
            dtype,
            rounding,
            seed: 0,
            frozen: None,
        }
    }

    /// bf16 weights with stochastic rounding.
    pub fn bf16() -> Self {
        WeightSpec::new(WeightDtype::Bf16, WeightRounding::Stochastic)
    }

    /// The same with the draws seeded by `seed`.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The same with the frozen weights held as `frozen`.
    pub fn with_frozen(mut self, frozen: Option<FrozenDtype>) -> Self {
        self.frozen = frozen;
        self
    }

    /// Whether the weights are in 16 bits.
    pub fn is_compressed(&self) -> bool {
        self.dtype != WeightDtype::F32
    }

    /// `"bf16 (stochastic rounding)"`, `"fp32"`: for logs and notices.
    pub fn describe(&self) -> String {
        let trainable = if self.is_compressed() {
            format!("{} ({} rounding)", self.dtype, self.rounding)
        } else {
            self.dtype.to_string()
        };
        match self.frozen {
            Some(frozen) => format!("{trainable}, frozen in {frozen}"),
            None => trainable,
        }
    }
}

/// How frozen weights are held (`[optimizer] frozen_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FrozenDtype {
    /// int8 per output channel (dimension 0), one fp32 scale per channel: a quarter of fp32.
    #[serde(rename = "int8")]
    Int8,
    /// bfloat16: half of fp32.
    #[serde(rename = "bf16")]
    Bf16,
}

impl std::fmt::Display for FrozenDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FrozenDtype::Int8 => "int8",
            FrozenDtype::Bf16 => "bf16",
        })
    }
}

/// One step's count of the updates that left their weight where it was: `moved` values had a
/// non-zero fp32 update, `unchanged` of them kept their 16-bit value (rounding to nearest:
/// lost; stochastic: not drawn this time; Kahan: kept in the compensation).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepRounding {
    /// Values whose fp32 update was not zero.
    pub moved: f64,
    /// Of those, the values whose stored weight did not change.
    pub unchanged: f64,
}

impl StepRounding {
    /// `unchanged / moved` (0 without an update).
    pub fn fraction(&self) -> f64 {
        if self.moved > 0.0 {
            self.unchanged / self.moved
        } else {
            0.0
        }
    }

    /// The warning a run's first step of weights kept in `dtype` with `rounding` gives: f16
    /// weights that leave more than 1% of the updates where they were.
    pub fn first_step_warning(
        &self,
        dtype: WeightDtype,
        rounding: WeightRounding,
    ) -> Option<String> {
        if dtype != WeightDtype::F16 || self.fraction() <= 0.01 {
            return None;
        }
        let what = match rounding {
            WeightRounding::Nearest => "were lost",
            WeightRounding::Stochastic => {
                "left their weight unchanged (kept only on average, by the random rounding)"
            }
            WeightRounding::Kahan => "left their weight unchanged (kept in the Kahan compensation)",
        };
        Some(format!(
            "`optimizer.weight_dtype = \"f16\"`: {:.1}% of the first step's updates {what}, being \
             smaller than half f16's spacing at their weight; \"bf16\" keeps fp32's range",
            100.0 * self.fraction()
        ))
    }
}
