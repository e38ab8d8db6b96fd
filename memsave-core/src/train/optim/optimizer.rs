//! The optimizer over a model: built from its spec, stepped, its state kept to the owned
//! parameters, saved and restored.

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::SimpleOptimizer;
use burn::optim::{Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::AutodiffBackend;

use crate::train::optim8::{Adam8, Sgd8};
use crate::train::snapshot::codec::{decode_by_param, encode_by_param, CodecError};
use crate::Result;
use memsave_common::optim::{OptimizerKind, OptimizerSpec, StateDtype};

/// One of the supported optimizers over the model `M`.
pub enum Optim<B: AutodiffBackend, M: AutodiffModule<B>> {
    /// SGD.
    Sgd(OptimizerAdaptor<burn::optim::Sgd<B::InnerBackend>, M, B>),
    /// Adam.
    Adam(OptimizerAdaptor<Adam, M, B>),
    /// AdamW.
    AdamW(OptimizerAdaptor<AdamW, M, B>),
    /// SGD with its momentum in 8 bits.
    Sgd8(OptimizerAdaptor<Sgd8, M, B>),
    /// Adam or AdamW with their moments in 8 bits.
    Adam8(OptimizerAdaptor<Adam8, M, B>),
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Clone for Optim<B, M> {
    fn clone(&self) -> Self {
        match self {
            Optim::Sgd(optim) => Optim::Sgd(optim.clone()),
            Optim::Adam(optim) => Optim::Adam(optim.clone()),
            Optim::AdamW(optim) => Optim::AdamW(optim.clone()),
            Optim::Sgd8(optim) => Optim::Sgd8(optim.clone()),
            Optim::Adam8(optim) => Optim::Adam8(optim.clone()),
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
    pub fn new(spec: impl Into<OptimizerSpec>) -> Self {
        let spec = spec.into();
        if spec.state_dtype == StateDtype::Int8 {
            return Self::eight_bit(&spec.kind);
        }
        let kind = &spec.kind;
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

    /// The optimizer `kind` with its state in 8 bits.
    fn eight_bit(kind: &OptimizerKind) -> Self {
        match kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => Optim::Sgd8(OptimizerAdaptor::from(Sgd8 {
                momentum: *momentum,
                dampening: 0.0,
                nesterov: *nesterov,
                weight_decay: (*weight_decay > 0.0).then_some(*weight_decay as f32),
                eight_bit: true,
            })),
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => {
                let (betas, eps, weight_decay) = kind.adam_settings();
                Optim::Adam8(OptimizerAdaptor::from(Adam8 {
                    beta_1: betas.0 as f32,
                    beta_2: betas.1 as f32,
                    epsilon: eps as f32,
                    weight_decay: weight_decay as f32,
                    decoupled: matches!(kind, OptimizerKind::AdamW { .. }),
                    eight_bit: true,
                }))
            }
        }
    }

    /// One optimizer step.
    pub fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self {
            Optim::Sgd(optim) => optim.step(lr, module, grads),
            Optim::Adam(optim) => optim.step(lr, module, grads),
            Optim::AdamW(optim) => optim.step(lr, module, grads),
            Optim::Sgd8(optim) => optim.step(lr, module, grads),
            Optim::Adam8(optim) => optim.step(lr, module, grads),
        }
    }

    /// Keeps the state of the parameters in `owned` only: a peer's part of a state sharded
    /// across data-parallel peers (ZeRO), after a resume from a whole one.
    pub fn retain(&mut self, owned: &std::collections::HashSet<ParamId>) {
        fn keep<O, M, B>(
            optim: &mut OptimizerAdaptor<O, M, B>,
            owned: &std::collections::HashSet<ParamId>,
        ) where
            O: SimpleOptimizer<B::InnerBackend>,
            M: AutodiffModule<B>,
            B: AutodiffBackend,
        {
            let record = optim
                .to_record()
                .into_iter()
                .filter(|(id, _)| owned.contains(id))
                .collect();
            *optim = optim.clone().load_record(record);
        }
        match self {
            Optim::Sgd(optim) => keep(optim, owned),
            Optim::Adam(optim) => keep(optim, owned),
            Optim::AdamW(optim) => keep(optim, owned),
            Optim::Sgd8(optim) => keep(optim, owned),
            Optim::Adam8(optim) => keep(optim, owned),
        }
    }

    /// The optimizer's state (momentum buffers, moments) as bytes; the same state always gives
    /// the same bytes (entries in parameter order, not in hash-map order).
    pub fn to_bytes(&self) -> Result<Vec<u8>, CodecError> {
        match self {
            Optim::Sgd(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::Adam(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::AdamW(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::Sgd8(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::Adam8(optim) => encode_by_param::<B, _>(optim.to_record()),
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
            Optim::Sgd8(optim) => {
                Optim::Sgd8(optim.load_record(decode_by_param::<B, _, _>(bytes, device)?))
            }
            Optim::Adam8(optim) => {
                Optim::Adam8(optim.load_record(decode_by_param::<B, _, _>(bytes, device)?))
            }
        })
    }
}
