//! The sections of a configuration that are not a runtime type as they stand: the optimizer
//! (its learning rate beside the optimizer's kind), the optimizer hook (MMCV's hook names, each
//! a corner of the runtime's `OptimizerHook`), and mixed precision (MMCV's three forms of
//! `loss_scale`). Every other section deserialises straight into its runtime type.

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use smart_default::SmartDefault;

use crate::clip::GradClip;
use crate::fp16::Precision;
use crate::optim::{OptimizerKind, StateDtype};
use crate::scaler::{LossScaler, ScaleMode};
use crate::weights::{WeightDtype, WeightRounding};
use crate::Result;

/// `[optimizer]`: `type`, `lr`, how the state is kept, and the optimizer's parameters.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct OptimizerSection {
    /// The base learning rate (the schedule's).
    pub lr: f64,
    /// `"fp32"` (default) or `"int8"`: the state in 8-bit blocks (bitsandbytes' and torchao's
    /// 8-bit optimizers; approximate).
    #[serde(default)]
    pub state_dtype: StateDtype,
    /// `"fp32"` (default), `"bf16"` or `"f16"`: the trainable weights in 16 bits as their only
    /// copy (parameter compression), the forward running on them.
    #[serde(default)]
    pub weight_dtype: WeightDtype,
    /// `"stochastic"` (default), `"nearest"` or `"kahan"`: how each fp32 update is rounded
    /// back to the 16-bit weights.
    #[serde(default)]
    pub weight_rounding: WeightRounding,
    /// `"int8"` (per output channel, a scale each) or `"bf16"`: the frozen weights (those that
    /// do not train: `frozen_stages`, a frozen submodule) held so, dequantized per layer in the
    /// forward. Absent: as the trainable weights.
    #[serde(default)]
    pub frozen_dtype: Option<crate::weights::FrozenDtype>,
    /// The optimizer and its parameters.
    #[serde(flatten)]
    pub kind: OptimizerKind,
}

/// `[optimizer_config]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerHookSection {
    /// `OptimizerHook` (default) or `GradientCumulativeOptimizerHook`; with `[fp16]`, the fp16
    /// variant of either.
    #[serde(rename = "type")]
    pub kind: OptimizerHookType,
    /// Micro-batches per optimizer step (accumulation only).
    pub cumulative_iters: Option<usize>,
    /// Global-norm gradient clipping: `{ max_norm = 35.0, norm_type = 2.0 }`.
    pub grad_clip: Option<GradClip>,
    /// Report trainable parameters without a gradient.
    pub detect_anomalous_params: bool,
    /// Step each parameter in backward as soon as its gradient is final and free the gradient
    /// (PyTorch's optimizer hooks in backward): the whole gradient set never exists. Exact;
    /// with `grad_clip` or `[fp16]`, each step runs its forward and backward twice.
    pub step_in_backward: bool,
    /// Shard across the data-parallel peers (ZeRO, PyTorch's `ZeroRedundancyOptimizer`): 0
    /// off, 1 the optimizer state, 2 the optimizer state and the averaged gradients. Each peer
    /// steps its part of the parameters and sends every peer the new values. Exact.
    pub zero_stage: u8,
}

impl OptimizerHookSection {
    /// The ZeRO stage this section asks for; errors name `optimizer_config.zero_stage`.
    pub fn zero(&self) -> crate::Result<crate::parallel::ZeroStage> {
        crate::parallel::ZeroStage::from_number(self.zero_stage).map_err(|error| match error {
            crate::Error::InvalidValue { message, .. } => {
                crate::Error::invalid("optimizer_config.zero_stage", message)
            }
            other => other,
        })
    }

    /// The grouping of micro-batches this section asks for: `cumulative_iters` for the
    /// accumulating hooks (1 when unset), a step every iteration for the others. Errors name
    /// `cumulative_iters`.
    pub fn groups(&self) -> crate::Result<crate::groups::Groups> {
        let iters = if self.kind.accumulates() {
            self.cumulative_iters.unwrap_or(1)
        } else {
            1
        };
        crate::groups::Groups::new(iters)
    }
}

/// The optimizer hooks, by MMCV's names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum OptimizerHookType {
    /// Backward, clip, step.
    #[default]
    OptimizerHook,
    /// Mixed precision (also chosen by an `[fp16]` section).
    Fp16OptimizerHook,
    /// Gradient accumulation.
    GradientCumulativeOptimizerHook,
    /// Accumulation under mixed precision.
    GradientCumulativeFp16OptimizerHook,
}

impl OptimizerHookType {
    /// Whether the hook accumulates.
    pub fn accumulates(self) -> bool {
        matches!(
            self,
            OptimizerHookType::GradientCumulativeOptimizerHook
                | OptimizerHookType::GradientCumulativeFp16OptimizerHook
        )
    }

    /// Whether the hook runs in mixed precision by its name alone.
    pub fn is_fp16(self) -> bool {
        matches!(
            self,
            OptimizerHookType::Fp16OptimizerHook
                | OptimizerHookType::GradientCumulativeFp16OptimizerHook
        )
    }
}

/// `[fp16]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Fp16Section {
    /// A number (static), `"dynamic"`, or a table of the scaler's parameters.
    pub loss_scale: LossScaleSpec,
    /// `"f16"` (default) or `"bf16"`.
    pub precision: Precision,
}

/// The forms of `fp16.loss_scale`.
#[derive(Clone, Debug, PartialEq)]
pub enum LossScaleSpec {
    /// A fixed scale: `loss_scale = 512.0` (an integer is accepted).
    Static(f64),
    /// `loss_scale = "dynamic"`: PyTorch's `GradScaler` defaults.
    Dynamic,
    /// `loss_scale = { ... }`: the scaler's parameters.
    Table(GradScalerParams),
}

impl Default for LossScaleSpec {
    /// MMCV's `Fp16OptimizerHook(loss_scale=512.)`.
    fn default() -> Self {
        LossScaleSpec::Static(crate::scaler::MMCV_STATIC_SCALE)
    }
}

/// The table form, with PyTorch's `GradScaler` names (and MMCV's `LossScaler` names as
/// aliases); unset ones take `GradScaler`'s defaults.
#[derive(Clone, Debug, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct GradScalerParams {
    /// Starting scale.
    #[default(65536.0)]
    pub init_scale: f64,
    /// `"dynamic"` or `"static"`.
    #[default(ScaleMode::Dynamic)]
    pub mode: ScaleMode,
    /// Growth factor (MMCV: `scale_factor`).
    #[serde(alias = "scale_factor")]
    #[default(2.0)]
    pub growth_factor: f64,
    /// Back-off factor on overflow (unset: `1 / growth_factor`).
    pub backoff_factor: Option<f64>,
    /// Clean iterations before growing (MMCV: `scale_window`).
    #[serde(alias = "scale_window")]
    #[default(2000)]
    pub growth_interval: u64,
}

impl<'de> Deserialize<'de> for LossScaleSpec {
    fn deserialize<De: Deserializer<'de>>(
        deserializer: De,
    ) -> std::result::Result<Self, De::Error> {
        struct Spec;
        impl<'de> Visitor<'de> for Spec {
            type Value = LossScaleSpec;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number, \"dynamic\", or a table of the scaler's parameters")
            }

            fn visit_f64<E: serde::de::Error>(
                self,
                value: f64,
            ) -> std::result::Result<Self::Value, E> {
                Ok(LossScaleSpec::Static(value))
            }

            fn visit_i64<E: serde::de::Error>(
                self,
                value: i64,
            ) -> std::result::Result<Self::Value, E> {
                Ok(LossScaleSpec::Static(value as f64))
            }

            fn visit_u64<E: serde::de::Error>(
                self,
                value: u64,
            ) -> std::result::Result<Self::Value, E> {
                Ok(LossScaleSpec::Static(value as f64))
            }

            fn visit_str<E: serde::de::Error>(
                self,
                value: &str,
            ) -> std::result::Result<Self::Value, E> {
                if value == "dynamic" {
                    Ok(LossScaleSpec::Dynamic)
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Str(value), &self))
                }
            }

            fn visit_map<A: MapAccess<'de>>(
                self,
                map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                GradScalerParams::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(LossScaleSpec::Table)
            }
        }
        deserializer.deserialize_any(Spec)
    }
}

impl LossScaleSpec {
    /// The scaler it describes. Errors name the scaler's parameter; [`super::Config`] puts
    /// the key in front.
    pub fn scaler(&self) -> Result<LossScaler> {
        match self {
            LossScaleSpec::Static(scale) => LossScaler::fixed(*scale),
            LossScaleSpec::Dynamic => LossScaleSpec::Table(GradScalerParams::default()).scaler(),
            LossScaleSpec::Table(table) => {
                let scaler = LossScaler::new(
                    table.init_scale,
                    table.mode,
                    table.growth_factor,
                    table.growth_interval,
                )?;
                match table.backoff_factor {
                    Some(backoff) => scaler.with_backoff_factor(backoff),
                    None => Ok(scaler),
                }
            }
        }
    }

    /// The key under `fp16.loss_scale` that a scaler's `parameter` was written as.
    pub(super) fn key(&self, parameter: &str) -> String {
        match (self, parameter) {
            (LossScaleSpec::Table(_), "scale_factor") => "fp16.loss_scale.growth_factor".into(),
            (LossScaleSpec::Table(_), "scale_window") => "fp16.loss_scale.growth_interval".into(),
            (LossScaleSpec::Table(_), other) => format!("fp16.loss_scale.{other}"),
            _ => "fp16.loss_scale".into(),
        }
    }
}

/// `[evaluation]`: evaluate the model on the validation data every `interval` epochs (or
/// iterations, for an iteration-based run).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvaluationSection {
    /// Epochs (iterations) between evaluations.
    #[serde(default = "one")]
    pub interval: usize,
    /// `"mAP"` (a VOC detector's, its default) or `"accuracy"` (top-1: a classifier's, its
    /// default).
    #[serde(default)]
    pub metric: Option<String>,
    /// Held-out samples to score a classifier on synthetic data (default 128): the training
    /// set's distribution, other noise (another seed). A detector reads `data.val`.
    #[serde(default)]
    pub num_samples: Option<usize>,
}

fn one() -> usize {
    1
}
