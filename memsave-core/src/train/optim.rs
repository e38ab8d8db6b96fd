//! The optimizers the runner drives: SGD with momentum and weight decay, Adam, AdamW.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::AutodiffBackend;

use serde::Deserialize;

use super::snapshot::codec::{decode_by_param, encode_by_param, CodecError};

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
    /// Copies of the trainable weights the optimizer keeps as state: SGD with momentum one
    /// (the momentum buffer), Adam and AdamW two (the moments), plain SGD none.
    pub fn state_copies(&self) -> u64 {
        match self {
            OptimizerKind::Sgd { momentum, .. } if *momentum > 0.0 => 1,
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => 2,
        }
    }
}

/// One of the supported optimizers over the model `M`.
pub enum Optim<B: AutodiffBackend, M: AutodiffModule<B>> {
    /// SGD.
    Sgd(OptimizerAdaptor<burn::optim::Sgd<B::InnerBackend>, M, B>),
    /// Adam.
    Adam(OptimizerAdaptor<Adam, M, B>),
    /// AdamW.
    AdamW(OptimizerAdaptor<AdamW, M, B>),
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Clone for Optim<B, M> {
    fn clone(&self) -> Self {
        match self {
            Optim::Sgd(optim) => Optim::Sgd(optim.clone()),
            Optim::Adam(optim) => Optim::Adam(optim.clone()),
            Optim::AdamW(optim) => Optim::AdamW(optim.clone()),
        }
    }
}

/// An Adam-family optimizer from its config type, betas, epsilon and weight decay.
macro_rules! adam {
    ($config:ident, $betas:expr, $eps:expr, $decay:expr) => {
        $config::new()
            .with_beta_1($betas.0 as f32)
            .with_beta_2($betas.1 as f32)
            .with_epsilon(*$eps as f32)
            .with_weight_decay($decay)
            .init()
    };
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Optim<B, M> {
    /// A fresh optimizer (no state yet).
    pub fn new(kind: &OptimizerKind) -> Self {
        let decay = |penalty: f64| (penalty > 0.0).then(|| WeightDecayConfig::new(penalty as f32));
        match kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                let momentum = (*momentum > 0.0).then_some(MomentumConfig {
                    momentum: *momentum,
                    dampening: 0.0,
                    nesterov: *nesterov,
                });
                Optim::Sgd(
                    SgdConfig::new()
                        .with_momentum(momentum)
                        .with_weight_decay(decay(*weight_decay))
                        .init(),
                )
            }
            // Adam and AdamW take the same three settings (the decay differs in kind).
            OptimizerKind::Adam {
                betas,
                eps,
                weight_decay,
            } => Optim::Adam(adam!(AdamConfig, betas, eps, decay(*weight_decay))),
            OptimizerKind::AdamW {
                betas,
                eps,
                weight_decay,
            } => Optim::AdamW(adam!(AdamWConfig, betas, eps, *weight_decay as f32)),
        }
    }

    /// One optimizer step.
    pub fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self {
            Optim::Sgd(optim) => optim.step(lr, module, grads),
            Optim::Adam(optim) => optim.step(lr, module, grads),
            Optim::AdamW(optim) => optim.step(lr, module, grads),
        }
    }

    /// The optimizer's state (momentum buffers, moments) as bytes; the same state always gives
    /// the same bytes (entries in parameter order, not in hash-map order).
    pub fn to_bytes(&self) -> Result<Vec<u8>, CodecError> {
        match self {
            Optim::Sgd(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::Adam(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::AdamW(optim) => encode_by_param::<B, _>(optim.to_record()),
        }
    }

    /// Restores the state saved by [`Optim::to_bytes`].
    pub fn load_bytes(self, bytes: &[u8], device: &B::Device) -> Result<Self, CodecError> {
        Ok(match self {
            Optim::Sgd(optim) => {
                Optim::Sgd(optim.load_record(decode_by_param::<B, _, _>(bytes, device)?))
            }
            Optim::Adam(optim) => {
                Optim::Adam(optim.load_record(decode_by_param::<B, _, _>(bytes, device)?))
            }
            Optim::AdamW(optim) => {
                Optim::AdamW(optim.load_record(decode_by_param::<B, _, _>(bytes, device)?))
            }
        })
    }
}
