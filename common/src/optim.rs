//! What an optimizer is configured by: its kind and parameters, and how it keeps its state.

use serde::{Deserialize, Serialize};

use crate::weights::WeightSpec;
use crate::{Error, Result};

/// Which optimizer, with MMCV's names (`optimizer = dict(type='SGD', lr=0.02, momentum=0.9,
/// weight_decay=0.0001)`; the learning rate is the schedule's). Unset parameters take
/// PyTorch's defaults.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum OptimizerKind {
    /// Stochastic gradient descent (PyTorch's `SGD`).
    #[serde(rename = "SGD")]
    Sgd {
        /// Momentum factor (0: none).
        #[serde(default)]
        momentum: f64,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f64,
        /// Nesterov momentum.
        #[serde(default)]
        nesterov: bool,
    },
    /// Adam (L2 weight decay added to the gradient).
    Adam {
        /// Coefficients of the running averages.
        #[serde(default = "adam_betas")]
        betas: (f64, f64),
        /// Added to the denominator.
        #[serde(default = "adam_eps")]
        eps: f64,
        /// L2 penalty.
        #[serde(default)]
        weight_decay: f64,
    },
    /// AdamW (decoupled weight decay).
    AdamW {
        /// Coefficients of the running averages.
        #[serde(default = "adam_betas")]
        betas: (f64, f64),
        /// Added to the denominator.
        #[serde(default = "adam_eps")]
        eps: f64,
        /// Decoupled weight decay (PyTorch's default 0.01).
        #[serde(default = "adamw_weight_decay")]
        weight_decay: f64,
    },
}

fn adam_betas() -> (f64, f64) {
    (0.9, 0.999)
}

fn adam_eps() -> f64 {
    1e-8
}

fn adamw_weight_decay() -> f64 {
    0.01
}

impl OptimizerKind {
    /// SGD with `momentum` (0: none), no weight decay, no Nesterov (PyTorch's defaults; the
    /// learning rate is the schedule's: the runner's `set_lr`).
    pub fn sgd(momentum: f64) -> Self {
        OptimizerKind::Sgd {
            momentum,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// SGD with Nesterov `momentum` (above 0), no weight decay.
    pub fn nesterov(momentum: f64) -> Self {
        OptimizerKind::Sgd {
            momentum,
            weight_decay: 0.0,
            nesterov: true,
        }
    }

    /// Adam with PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam() -> Self {
        OptimizerKind::Adam {
            betas: adam_betas(),
            eps: adam_eps(),
            weight_decay: 0.0,
        }
    }

    /// AdamW with PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn adamw() -> Self {
        OptimizerKind::AdamW {
            betas: adam_betas(),
            eps: adam_eps(),
            weight_decay: adamw_weight_decay(),
        }
    }

    /// This optimizer with weight decay `decay` (L2 for SGD and Adam, decoupled for AdamW).
    pub fn with_weight_decay(mut self, decay: f64) -> Self {
        match &mut self {
            OptimizerKind::Sgd { weight_decay, .. }
            | OptimizerKind::Adam { weight_decay, .. }
            | OptimizerKind::AdamW { weight_decay, .. } => *weight_decay = decay,
        }
        self
    }

    /// Copies of the trainable weights the optimizer keeps as state: SGD with momentum one
    /// (the momentum buffer), Adam and AdamW two (the moments), plain SGD none.
    pub fn state_copies(&self) -> u64 {
        match self {
            OptimizerKind::Sgd { momentum, .. } if *momentum > 0.0 => 1,
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => 2,
        }
    }

    /// Adam's and AdamW's settings: betas, eps and weight decay (zeros for SGD, which has none
    /// of them).
    pub fn adam_settings(&self) -> ((f64, f64), f64, f64) {
        match self {
            OptimizerKind::Sgd { .. } => ((0.0, 0.0), 0.0, 0.0),
            OptimizerKind::Adam {
                betas,
                eps,
                weight_decay,
            }
            | OptimizerKind::AdamW {
                betas,
                eps,
                weight_decay,
            } => (*betas, *eps, *weight_decay),
        }
    }

    /// This optimizer keeping its state as `state_dtype`.
    pub fn with_state_dtype(self, state_dtype: StateDtype) -> OptimizerSpec {
        OptimizerSpec {
            kind: self,
            state_dtype,
            weights: WeightSpec::FP32,
        }
    }
}

/// How an optimizer keeps its state (`[optimizer] state_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateDtype {
    /// fp32, as Burn's and PyTorch's optimizers.
    #[default]
    #[serde(rename = "fp32")]
    F32,
    /// Block-wise 8 bits with the dynamic map (bitsandbytes' and torchao's 8-bit optimizers:
    /// a quarter of the bytes; approximate).
    #[serde(rename = "int8")]
    Int8,
}

impl std::fmt::Display for StateDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StateDtype::F32 => "fp32",
            StateDtype::Int8 => "int8",
        })
    }
}

/// An optimizer and how it keeps its state: what the runner builds its optimizer from.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerSpec {
    /// The optimizer and its parameters.
    pub kind: OptimizerKind,
    /// How its state is kept.
    pub state_dtype: StateDtype,
    /// How the trainable weights are kept: fp32, or 16 bits as their only copy
    /// (memsave's `train::weights`).
    pub weights: WeightSpec,
}

impl From<OptimizerKind> for OptimizerSpec {
    fn from(kind: OptimizerKind) -> Self {
        kind.with_state_dtype(StateDtype::F32)
    }
}

impl From<&OptimizerKind> for OptimizerSpec {
    fn from(kind: &OptimizerKind) -> Self {
        kind.clone().into()
    }
}

impl From<&OptimizerSpec> for OptimizerSpec {
    fn from(spec: &OptimizerSpec) -> Self {
        spec.clone()
    }
}

impl OptimizerSpec {
    /// This optimizer keeping the trainable weights as `weights` says (16 bits: their only
    /// copy, each update rounded back by its rounding).
    pub fn with_weights(mut self, weights: WeightSpec) -> Self {
        self.weights = weights;
        self
    }

    /// Checks the values as PyTorch's optimizers do (errors name the parameter); 8 bits for an
    /// optimizer that keeps no state is an error naming `state_dtype`.
    pub fn validate(&self) -> Result<()> {
        let non_negative = |name: &str, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(Error::invalid(
                    name,
                    format!("must be a finite number, at least 0, got {value}"),
                ))
            }
        };
        match &self.kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                non_negative("momentum", *momentum)?;
                non_negative("weight_decay", *weight_decay)?;
                if *nesterov && *momentum == 0.0 {
                    return Err(Error::invalid(
                        "nesterov",
                        "Nesterov momentum needs a momentum above 0 (PyTorch's rule)",
                    ));
                }
            }
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => {
                let (betas, eps, weight_decay) = self.kind.adam_settings();
                for (i, beta) in [betas.0, betas.1].into_iter().enumerate() {
                    if !(0.0..1.0).contains(&beta) {
                        return Err(Error::invalid(
                            "betas",
                            format!("beta{} must be in [0, 1), got {beta}", i + 1),
                        ));
                    }
                }
                non_negative("eps", eps)?;
                non_negative("weight_decay", weight_decay)?;
            }
        }
        if self.state_dtype == StateDtype::Int8 && self.kind.state_copies() == 0 {
            return Err(Error::invalid(
                "state_dtype",
                "\"int8\" quantizes the optimizer's state, and SGD without momentum keeps none: \
                 set a momentum, or leave the state in \"fp32\"",
            ));
        }
        Ok(())
    }

    /// Bytes of optimizer state per byte of trainable fp32 weights: the state copies, each a
    /// quarter (one byte a value) plus one fp32 scale per block in 8 bits.
    pub fn state_per_weight(&self) -> f64 {
        let copies = self.kind.state_copies() as f64;
        match self.state_dtype {
            StateDtype::F32 => copies,
            StateDtype::Int8 => copies * (1.0 + 4.0 / crate::quant::BLOCK as f64) / 4.0,
        }
    }
}
