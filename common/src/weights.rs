//! What the trainable weights are kept in (`[optimizer] weight_dtype`): the setting and its
//! bytes. Each runtime maps it to its Burn's dtype.

use std::fmt;

use serde::{Deserialize, Serialize};

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
