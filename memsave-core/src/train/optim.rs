//! The optimizers the runner drives (SGD with momentum and weight decay, Adam, AdamW), and the
//! operations the optimizer hooks apply to a step's gradients.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor};

use crate::{Error, Result};

/// Which optimizer, with MMCV's parameter names (`optimizer = dict(type='SGD', lr=0.02,
/// momentum=0.9, weight_decay=0.0001)`).
#[derive(Clone, Debug, PartialEq)]
pub enum OptimizerKind {
    /// Stochastic gradient descent (PyTorch's `SGD`).
    Sgd {
        /// Momentum factor (0: none).
        momentum: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam (L2 weight decay added to the gradient).
    Adam {
        /// Coefficients of the running averages.
        betas: (f64, f64),
        /// Added to the denominator.
        eps: f64,
        /// L2 penalty.
        weight_decay: f64,
    },
    /// AdamW (decoupled weight decay).
    AdamW {
        /// Coefficients of the running averages.
        betas: (f64, f64),
        /// Added to the denominator.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
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
            OptimizerKind::Adam {
                betas,
                eps,
                weight_decay,
            } => Optim::Adam(
                AdamConfig::new()
                    .with_beta_1(betas.0 as f32)
                    .with_beta_2(betas.1 as f32)
                    .with_epsilon(*eps as f32)
                    .with_weight_decay(decay(*weight_decay))
                    .init(),
            ),
            OptimizerKind::AdamW {
                betas,
                eps,
                weight_decay,
            } => Optim::AdamW(
                AdamWConfig::new()
                    .with_beta_1(betas.0 as f32)
                    .with_beta_2(betas.1 as f32)
                    .with_epsilon(*eps as f32)
                    .with_weight_decay(*weight_decay as f32)
                    .init(),
            ),
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
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        match self {
            Optim::Sgd(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::Adam(optim) => encode_by_param::<B, _>(optim.to_record()),
            Optim::AdamW(optim) => encode_by_param::<B, _>(optim.to_record()),
        }
    }

    /// Restores the state saved by [`Optim::to_bytes`].
    pub fn load_bytes(self, bytes: &[u8], device: &B::Device) -> Result<Self> {
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

/// A per-parameter record as bytes, entries sorted by parameter id: a count (u64), then per
/// entry the id and the record, each length-prefixed (u64, little-endian).
fn encode_by_param<B: burn::prelude::Backend, R: burn::record::Record<B>>(
    record: impl IntoIterator<Item = (ParamId, R)>,
) -> Result<Vec<u8>> {
    let mut entries: Vec<(ParamId, R)> = record.into_iter().collect();
    entries.sort_by_key(|(id, _)| id.val());
    let mut out = (entries.len() as u64).to_le_bytes().to_vec();
    for (id, record) in entries {
        for part in [id.serialize().into_bytes(), record_bytes::<B, _>(record)?] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(&part);
        }
    }
    Ok(out)
}

fn decode_by_param<B, R, Map>(mut bytes: &[u8], device: &B::Device) -> Result<Map>
where
    B: burn::prelude::Backend,
    R: burn::record::Record<B>,
    Map: FromIterator<(ParamId, R)>,
{
    let truncated = || Error::invalid("checkpoint", "the optimizer state is truncated");
    let next = |bytes: &mut &[u8]| -> Result<Vec<u8>> {
        let (length, rest) = bytes.split_at_checked(8).ok_or_else(truncated)?;
        let length = u64::from_le_bytes(length.try_into().expect("eight bytes")) as usize;
        let (part, rest) = rest.split_at_checked(length).ok_or_else(truncated)?;
        *bytes = rest;
        Ok(part.to_vec())
    };
    let (count, rest) = bytes.split_at_checked(8).ok_or_else(truncated)?;
    let count = u64::from_le_bytes(count.try_into().expect("eight bytes"));
    bytes = rest;
    let mut record = Vec::new();
    for _ in 0..count {
        let id = String::from_utf8(next(&mut bytes)?)
            .ok()
            .and_then(|id| ParamId::try_deserialize(&id))
            .ok_or_else(|| {
                Error::invalid(
                    "checkpoint",
                    "a parameter id in the optimizer state is unreadable",
                )
            })?;
        record.push((id, load_bytes::<B, R>(&next(&mut bytes)?, device)?));
    }
    Ok(record.into_iter().collect())
}

/// A record as bytes (full precision, so that a resumed run continues exactly).
pub fn record_bytes<B: burn::prelude::Backend, R: burn::record::Record<B>>(
    record: R,
) -> Result<Vec<u8>> {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .record(record, ())
        .map_err(|error| Error::invalid("checkpoint", format!("could not encode: {error}")))
}

/// A record from bytes written by [`record_bytes`].
pub fn load_bytes<B: burn::prelude::Backend, R: burn::record::Record<B>>(
    bytes: &[u8],
    device: &B::Device,
) -> Result<R> {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .load(bytes.to_vec(), device)
        .map_err(|error| Error::invalid("checkpoint", format!("could not decode: {error}")))
}

/// `p`-norm of every gradient together (PyTorch's `clip_grad_norm_` total norm), in fp32;
/// `norm_type = inf` for the largest magnitude. `None` when there is no gradient.
pub fn global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
    norm_type: f64,
) -> Option<f64> {
    struct Norm<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        norm_type: f64,
        total: Option<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Norm<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
                return;
            };
            let grad = grad.cast(DType::F32);
            let part = if self.norm_type.is_infinite() {
                grad.abs().max()
            } else if self.norm_type == 2.0 {
                // No `abs` pass: squares are non-negative anyway.
                grad.square().sum()
            } else {
                grad.abs().powf_scalar(self.norm_type).sum()
            };
            self.total = Some(match self.total.take() {
                None => part,
                Some(total) if self.norm_type.is_infinite() => total.max_pair(part),
                Some(total) => total + part,
            });
        }
    }
    let mut norm = Norm::<B> {
        grads,
        norm_type,
        total: None,
    };
    model.visit(&mut norm);
    let total: f64 = norm.total?.into_scalar().elem::<f32>() as f64;
    Some(if norm_type.is_infinite() {
        total
    } else {
        total.powf(1.0 / norm_type)
    })
}

/// Applies `f` to every gradient of `model`'s parameters, in place.
pub fn map_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    f: &mut dyn FnMut(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
) {
    struct Map<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        f: &'a mut dyn FnMut(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Map<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let shape = grad.shape();
                let flat: Tensor<B::InnerBackend, 1> = grad.reshape([shape.num_elements()]);
                self.grads
                    .register::<B::InnerBackend, D>(param.id, (self.f)(flat).reshape(shape));
            }
        }
    }
    model.visit(&mut Map::<B> { grads, f });
}

/// Multiplies every gradient by `factor`.
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    map_grads::<B, M>(model, grads, &mut |grad| grad.mul_scalar(factor));
}

/// Casts every gradient to fp32 (half gradients onto the fp32 master weights).
pub fn grads_to_f32<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
) {
    map_grads::<B, M>(model, grads, &mut |grad| grad.cast(DType::F32));
}

/// `sum += more`, parameter by parameter (a parameter missing on one side keeps the other's).
pub fn accumulate_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    sum: &mut GradientsParams,
    mut more: GradientsParams,
) {
    struct Add<'a> {
        sum: &'a mut GradientsParams,
        more: &'a mut GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(grad) = self.more.remove::<B::InnerBackend, D>(param.id) else {
                return;
            };
            let total = match self.sum.remove::<B::InnerBackend, D>(param.id) {
                Some(previous) => previous + grad,
                None => grad,
            };
            self.sum.register::<B::InnerBackend, D>(param.id, total);
        }
    }
    model.visit(&mut Add {
        sum,
        more: &mut more,
    });
}

/// The module paths of the trainable parameters that have no gradient (MMCV's
/// `detect_anomalous_params`).
pub fn params_without_grad<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<String> {
    struct Find<'a> {
        grads: &'a GradientsParams,
        path: Vec<String>,
        missing: Vec<String>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Find<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let trainable = param.val().is_require_grad();
            if trainable && self.grads.get::<B::InnerBackend, D>(param.id).is_none() {
                self.missing.push(self.path.join("."));
            }
        }
    }
    let mut find = Find {
        grads,
        path: Vec::new(),
        missing: Vec::new(),
    };
    model.visit(&mut find);
    find.missing
}

/// Whether `model` contains a BatchNorm (memsave's or Burn's), found by its type name.
pub fn has_batch_norm<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> bool {
    struct Find(bool);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Find {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            self.0 |= container_type == "Struct:BatchNorm";
        }
    }
    let mut find = Find(false);
    model.visit(&mut find);
    find.0
}

/// Bytes of `model`'s float parameters: all of them, and the trainable ones.
pub fn param_bytes<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> (u64, u64) {
    struct Bytes(u64, u64);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Bytes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let bytes = (value.shape().num_elements() * value.dtype().size()) as u64;
            self.0 += bytes;
            if value.is_require_grad() {
                self.1 += bytes;
            }
        }
    }
    let mut bytes = Bytes(0, 0);
    model.visit(&mut bytes);
    (bytes.0, bytes.1)
}

/// Parameter ids with their shapes, in visiting order: a model's signature, to check that a
/// checkpoint belongs to it.
pub fn param_shapes<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
) -> Vec<(ParamId, Vec<usize>)> {
    struct Shapes(Vec<(ParamId, Vec<usize>)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0
                .push((param.id, param.lazy_shape().dims::<D>().to_vec()));
        }
    }
    let mut shapes = Shapes(Vec::new());
    model.visit(&mut shapes);
    shapes.0
}
