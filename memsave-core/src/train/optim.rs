//! The optimizers the runner drives: SGD with momentum and weight decay, Adam, AdamW.

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::record::AdaptorRecord;
use burn::optim::SimpleOptimizer;
use burn::optim::{Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use serde::{Deserialize, Serialize};

use super::optim8::{Adam8, Sgd8};
use super::snapshot::codec::{decode_by_param, encode_by_param, CodecError};
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
    /// learning rate is the schedule's: [`crate::train::Runner::set_lr`]).
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

    /// This optimizer keeping its state as `state_dtype`.
    pub fn with_state_dtype(self, state_dtype: StateDtype) -> OptimizerSpec {
        OptimizerSpec {
            kind: self,
            state_dtype,
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
            OptimizerKind::Adam {
                betas,
                eps,
                weight_decay,
            }
            | OptimizerKind::AdamW {
                betas,
                eps,
                weight_decay,
            } => {
                for (i, beta) in [betas.0, betas.1].into_iter().enumerate() {
                    if !(0.0..1.0).contains(&beta) {
                        return Err(Error::invalid(
                            "betas",
                            format!("beta{} must be in [0, 1), got {beta}", i + 1),
                        ));
                    }
                }
                non_negative("eps", *eps)?;
                non_negative("weight_decay", *weight_decay)?;
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
            StateDtype::Int8 => copies * (1.0 + 4.0 / super::quant::BLOCK as f64) / 4.0,
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
            OptimizerKind::Adam {
                betas,
                eps,
                weight_decay,
            }
            | OptimizerKind::AdamW {
                betas,
                eps,
                weight_decay,
            } => Optim::Adam8(OptimizerAdaptor::from(Adam8 {
                beta_1: betas.0 as f32,
                beta_2: betas.1 as f32,
                epsilon: *eps as f32,
                weight_decay: *weight_decay as f32,
                decoupled: matches!(kind, OptimizerKind::AdamW { .. }),
                eight_bit: true,
            })),
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

/// An optimizer's per-parameter step, with its state taken out of the optimizer while a
/// backward pass steps the parameters one by one as their gradients become final
/// ([`Optim::take_steps`], [`Optim::put_back`]). Each step is the optimizer's own arithmetic
/// on the same tensors as [`Optim::step`]'s: the same bits.
pub(crate) enum ParamSteps<B: AutodiffBackend> {
    Sgd(StepsOf<burn::optim::Sgd<B::InnerBackend>, B>),
    Adam(StepsOf<Adam, B>),
    AdamW(StepsOf<AdamW, B>),
    Sgd8(StepsOf<Sgd8, B>),
    Adam8(StepsOf<Adam8, B>),
}

/// One optimizer's rule and the state of each parameter.
pub(crate) struct StepsOf<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
    optim: O,
    records: std::collections::HashMap<ParamId, AdaptorRecord<O, B>>,
}

impl<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> StepsOf<O, B> {
    fn take<M: AutodiffModule<B>>(adaptor: &mut OptimizerAdaptor<O, M, B>) -> Self {
        let records = adaptor.to_record().into_iter().collect();
        *adaptor = adaptor.clone().load_record(Default::default());
        StepsOf {
            optim: adaptor.optim().clone(),
            records,
        }
    }

    fn put_back<M: AutodiffModule<B>>(self, adaptor: &mut OptimizerAdaptor<O, M, B>) {
        *adaptor = adaptor
            .clone()
            .load_record(self.records.into_iter().collect());
    }

    /// As `OptimizerAdaptor`'s step of one parameter.
    fn step<const D: usize>(
        &mut self,
        lr: f64,
        id: ParamId,
        tensor: Tensor<B::InnerBackend, D>,
        grad: Tensor<B::InnerBackend, D>,
    ) -> Tensor<B::InnerBackend, D> {
        let device = grad.device();
        let (key, record) = self.records.remove_entry(&id).unzip();
        let (tensor, state) = self.optim.step(
            lr,
            tensor,
            grad,
            record.map(|record| O::to_device(record.into_state(), &device)),
        );
        if let Some(state) = state {
            self.records
                .insert(key.unwrap_or(id), AdaptorRecord::from_state(state));
        }
        tensor
    }
}

impl<B: AutodiffBackend> ParamSteps<B> {
    /// Steps the parameter `id` of value `tensor` with its final gradient `grad`.
    pub(crate) fn step<const D: usize>(
        &mut self,
        lr: f64,
        id: ParamId,
        tensor: Tensor<B::InnerBackend, D>,
        grad: Tensor<B::InnerBackend, D>,
    ) -> Tensor<B::InnerBackend, D> {
        match self {
            ParamSteps::Sgd(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::Adam(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::AdamW(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::Sgd8(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::Adam8(steps) => steps.step(lr, id, tensor, grad),
        }
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Optim<B, M> {
    /// The per-parameter steps, the state moved out of the optimizer (no second copy of it
    /// exists while they run); [`Optim::put_back`] returns it.
    pub(crate) fn take_steps(&mut self) -> ParamSteps<B> {
        match self {
            Optim::Sgd(optim) => ParamSteps::Sgd(StepsOf::take(optim)),
            Optim::Adam(optim) => ParamSteps::Adam(StepsOf::take(optim)),
            Optim::AdamW(optim) => ParamSteps::AdamW(StepsOf::take(optim)),
            Optim::Sgd8(optim) => ParamSteps::Sgd8(StepsOf::take(optim)),
            Optim::Adam8(optim) => ParamSteps::Adam8(StepsOf::take(optim)),
        }
    }

    /// Returns the state [`Optim::take_steps`] took, as the steps left it.
    pub(crate) fn put_back(&mut self, steps: ParamSteps<B>) {
        match (self, steps) {
            (Optim::Sgd(optim), ParamSteps::Sgd(steps)) => steps.put_back(optim),
            (Optim::Adam(optim), ParamSteps::Adam(steps)) => steps.put_back(optim),
            (Optim::AdamW(optim), ParamSteps::AdamW(steps)) => steps.put_back(optim),
            (Optim::Sgd8(optim), ParamSteps::Sgd8(steps)) => steps.put_back(optim),
            (Optim::Adam8(optim), ParamSteps::Adam8(steps)) => steps.put_back(optim),
            _ => unreachable!("the steps were taken from this optimizer"),
        }
    }
}
