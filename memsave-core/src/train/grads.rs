//! The operations the optimizer hook applies to a step's gradients, each written once: the
//! backward pass (scaled, accumulating, joining the recompute threads), unscaling, the global
//! norm and clipping, the cast onto fp32 master weights, and the parameters without gradient.

use std::any::TypeId;
use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, ElementConversion, Tensor, TensorPrimitive};
use serde::Deserialize;

use crate::{Error, Result};

/// Gradient clipping by the global norm over all parameters (PyTorch's `clip_grad_norm_`, as
/// MMCV's `grad_clip = dict(max_norm=35, norm_type=2)`); Burn's own clipping is per tensor.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(try_from = "GradClipFields")]
pub struct GradClip {
    /// The largest global norm allowed.
    pub max_norm: f64,
    /// The norm's `p` (2 by default; `f64::INFINITY` for the largest magnitude).
    pub norm_type: f64,
}

/// [`GradClip`] as written, before [`GradClip::new`] checks it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GradClipFields {
    max_norm: f64,
    #[serde(default = "GradClip::default_norm_type")]
    norm_type: f64,
}

impl TryFrom<GradClipFields> for GradClip {
    type Error = Error;

    fn try_from(fields: GradClipFields) -> Result<Self> {
        GradClip::new(fields.max_norm, fields.norm_type)
    }
}

impl GradClip {
    fn default_norm_type() -> f64 {
        2.0
    }

    /// Checks the values: a positive `max_norm`, a `norm_type` of at least 1 (or infinite).
    pub fn new(max_norm: f64, norm_type: f64) -> Result<Self> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(Error::invalid(
                "max_norm",
                format!("must be a positive number, got {max_norm}"),
            ));
        }
        if norm_type.is_nan() || norm_type < 1.0 {
            return Err(Error::invalid(
                "norm_type",
                format!("must be at least 1 (or inf), got {norm_type}"),
            ));
        }
        Ok(GradClip {
            max_norm,
            norm_type,
        })
    }
}

/// The value of a one-element tensor, as f64.
pub(crate) fn scalar<B: Backend>(value: &Tensor<B, 1>) -> f64 {
    value.clone().cast(DType::F32).into_scalar().elem::<f32>() as f64
}

/// `backward(loss)` with the parameters' gradients of `model` as [`GradientsParams`], once
/// every recompute thread of the step has ended. When `accumulated` holds gradients of earlier
/// micro-batches (for the same parameters), they are handed to the backward pass as the
/// starting values of the parameters' gradients: each new gradient is added to its sum as it is
/// produced, so that no second full set of gradients ever exists (on Burn's `Autodiff` over any
/// backend, under any checkpoint strategy; elsewhere the two sets are added after the pass).
pub fn backward<B: AutodiffBackend, M: AutodiffModule<B>>(
    loss: Tensor<B, 1>,
    model: &M,
    accumulated: Option<GradientsParams>,
) -> GradientsParams {
    let (loss, leftover) = match accumulated {
        Some(sums) => seed_with::<B, M>(loss, model, sums),
        None => (loss, None),
    };
    let mut grads = GradientsParams::from_grads(loss.backward(), model);
    crate::checkpoint::join_helpers();
    if let Some(sums) = leftover {
        let new = std::mem::replace(&mut grads, sums);
        accumulate::<B, M>(model, &mut grads, new);
    }
    grads
}

/// `sum += more`, parameter by parameter (a parameter missing on one side keeps the other's;
/// `more`'s gradients are cast to the sum's precision where they differ).
pub fn accumulate<B: AutodiffBackend, M: AutodiffModule<B>>(
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
            let total = add_to_sum(self.sum.remove::<B::InnerBackend, D>(param.id), grad);
            self.sum.register::<B::InnerBackend, D>(param.id, total);
        }
    }
    model.visit(&mut Add {
        sum,
        more: &mut more,
    });
}

/// `previous + grad`, `grad` cast to the sum's precision where they differ (a half gradient is
/// added to an fp32 sum as it is cast, one parameter at a time: no full fp32 copy of the half
/// gradients is made); `grad` alone without a sum.
pub(crate) fn add_to_sum<K: Backend, const D: usize>(
    previous: Option<Tensor<K, D>>,
    grad: Tensor<K, D>,
) -> Tensor<K, D> {
    match previous {
        Some(previous) if previous.dtype() != grad.dtype() => {
            let dtype = previous.dtype();
            previous + grad.cast(dtype)
        }
        Some(previous) => previous + grad,
        None => grad,
    }
}

/// A copy of `grads` (the same tensors, shared), parameter by parameter.
pub(crate) fn share<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> GradientsParams {
    struct Share<'a> {
        grads: &'a GradientsParams,
        copy: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Share<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.copy.register::<B::InnerBackend, D>(param.id, grad);
            }
        }
    }
    let mut share = Share {
        grads,
        copy: GradientsParams::new(),
    };
    model.visit(&mut share);
    share.copy
}

/// `loss + 0` whose backward first registers `sums` on the parameters' nodes (see
/// [`backward`]); on a backend without the node, `loss` and `sums` back.
pub(crate) fn seed_with<B: AutodiffBackend, M: AutodiffModule<B>>(
    loss: Tensor<B, 1>,
    model: &M,
    sums: GradientsParams,
) -> (Tensor<B, 1>, Option<GradientsParams>) {
    // Burn's autodiff (any checkpoint strategy) over whatever inner backend: its nodes can be
    // seeded.
    if TypeId::of::<FloatTensor<B>>() == TypeId::of::<FloatTensor<Autodiff<B::InnerBackend>>>() {
        return (seeded::<B, M, B::InnerBackend>(loss, model, sums), None);
    }
    (loss, Some(sums))
}

fn seeded<B: AutodiffBackend, M: AutodiffModule<B>, K: Backend>(
    loss: Tensor<B, 1>,
    model: &M,
    mut sums: GradientsParams,
) -> Tensor<B, 1> {
    // The parameters' nodes in this forward, with their sums (moved out of `sums`).
    struct Take<'a, B: AutodiffBackend, K: Backend> {
        sums: &'a mut GradientsParams,
        seeds: Vec<(NodeId, FloatTensor<K>)>,
        _backend: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend, K: Backend> ModuleVisitor<B> for Take<'_, B, K> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(sum) = self.sums.remove::<B::InnerBackend, D>(param.id) else {
                return;
            };
            let node = cast::<FloatTensor<B>, FloatTensor<Autodiff<K>>>(
                param.val().into_primitive().tensor(),
            )
            .node
            .id;
            let sum =
                cast::<FloatTensor<B::InnerBackend>, FloatTensor<K>>(sum.into_primitive().tensor());
            self.seeds.push((node, sum));
        }
    }
    let mut take = Take::<B, K> {
        sums: &mut sums,
        seeds: Vec::new(),
        _backend: std::marker::PhantomData,
    };
    model.visit(&mut take);
    let seeds = take.seeds;
    let loss_primitive =
        cast::<FloatTensor<B>, FloatTensor<Autodiff<K>>>(loss.clone().into_primitive().tensor());
    let zero = Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(Autodiff::<K>::inner(
        loss_primitive.clone(),
    )))
    .zeros_like()
    .into_primitive()
    .tensor();
    let seed = match Seed
        .prepare::<NoCheckpointing>([loss_primitive.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(Seeds(Arc::new(Mutex::new(seeds))), zero),
        OpsKind::UnTracked(prep) => prep.finish(zero),
    };
    let seed = cast::<FloatTensor<Autodiff<K>>, FloatTensor<B>>(seed);
    loss + Tensor::from_primitive(TensorPrimitive::Float(seed))
}

fn cast<F: 'static, T: 'static>(value: F) -> T {
    let boxed: Box<dyn std::any::Any> = Box::new(value);
    *boxed
        .downcast::<T>()
        .ok()
        .expect("the backend's tensors were checked to be these")
}

/// The gradient sums, registered once by the first step of the backward pass.
#[derive(Clone)]
struct Seeds<K: Backend>(Arc<Mutex<Vec<(NodeId, FloatTensor<K>)>>>);

impl<K: Backend> fmt::Debug for Seeds<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Seeds")
    }
}

/// A node over the loss, one depth above it: its step runs before any gradient is computed.
/// It registers the sums on the parameters' nodes, passes nothing to the loss (its value is 0),
/// and frees them from itself: from then on each sum lives in the gradients container only.
#[derive(Debug)]
struct Seed;

impl<K: Backend> Backward<K, 1> for Seed {
    type State = Seeds<K>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let _ = grads.consume::<K>(&ops.node);
        let seeds = std::mem::take(
            &mut *ops
                .state
                .0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for (node, sum) in seeds {
            grads.register::<K>(node, sum);
        }
    }
}

/// Applies `f` to every gradient of `model`'s parameters, in place.
pub(crate) fn map_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
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

/// `grads` split into groups of parameters, in the model's order, each holding at most about
/// `limit` bytes of gradients counted at 4 bytes an element (one parameter more, when a single
/// one is larger): the optimizer steps a group at a time (see `TrainState::step`). The tensors
/// are moved, not copied.
pub(crate) fn into_chunks<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mut grads: GradientsParams,
    limit: usize,
) -> Vec<GradientsParams> {
    struct Split<'a> {
        grads: &'a mut GradientsParams,
        chunks: Vec<GradientsParams>,
        current: GradientsParams,
        bytes: usize,
        limit: usize,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Split<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
                return;
            };
            self.bytes += grad.shape().num_elements() * 4;
            self.current.register::<B::InnerBackend, D>(param.id, grad);
            if self.bytes >= self.limit {
                self.chunks
                    .push(std::mem::replace(&mut self.current, GradientsParams::new()));
                self.bytes = 0;
            }
        }
    }
    let mut split = Split {
        grads: &mut grads,
        chunks: Vec::new(),
        current: GradientsParams::new(),
        bytes: 0,
        limit,
    };
    model.visit(&mut split);
    let Split {
        mut chunks,
        current,
        ..
    } = split;
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Multiplies every gradient by `factor` (unscaling: `1 / loss_scale`).
pub fn scale<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    map_grads::<B, M>(model, grads, &mut |grad| grad.mul_scalar(factor));
}

/// Casts every gradient to fp32 (half gradients onto the fp32 master weights).
pub(crate) fn to_f32<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
) {
    map_grads::<B, M>(model, grads, &mut |grad| grad.cast(DType::F32));
}

/// `p`-norm of every gradient together (PyTorch's `clip_grad_norm_` total norm), in fp32;
/// `norm_type = inf` for the largest magnitude. `None` when there is no gradient.
pub fn global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
    norm_type: f64,
) -> Option<f64> {
    struct Parts<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        norm_type: f64,
        parts: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Parts<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.parts.push(norm_part(grad, self.norm_type));
            }
        }
    }
    let mut parts = Parts::<B> {
        grads,
        norm_type,
        parts: Vec::new(),
    };
    model.visit(&mut parts);
    combine_norm(parts.parts, norm_type)
}

/// One gradient's part of the global `p`-norm, in fp32: the sum of `|g|^p` (of `g^2` for
/// `p = 2`), or the largest `|g|` for `p = inf`.
pub(crate) fn norm_part<K: Backend, const D: usize>(
    grad: Tensor<K, D>,
    norm_type: f64,
) -> Tensor<K, 1> {
    let grad = grad.cast(DType::F32);
    if norm_type.is_infinite() {
        grad.abs().max()
    } else if norm_type == 2.0 {
        // No `abs` pass: squares are non-negative anyway.
        grad.square().sum()
    } else {
        grad.abs().powf_scalar(norm_type).sum()
    }
}

/// The global norm of the [`norm_part`]s, added in the order given (the model's: the same bits
/// wherever the parts were computed).
pub(crate) fn combine_norm<K: Backend>(
    parts: impl IntoIterator<Item = Tensor<K, 1>>,
    norm_type: f64,
) -> Option<f64> {
    let mut total: Option<Tensor<K, 1>> = None;
    for part in parts {
        total = Some(match total.take() {
            None => part,
            Some(total) if norm_type.is_infinite() => total.max_pair(part),
            Some(total) => total + part,
        });
    }
    let total = scalar(&total?);
    Some(if norm_type.is_infinite() {
        total
    } else {
        total.powf(1.0 / norm_type)
    })
}

/// The global norm of `grads` (`clip`'s `p`, else 2), clipping them to `clip.max_norm`. The
/// norm before clipping is returned (for the log, and as the overflow test: it is not finite
/// when a gradient is inf or NaN).
#[cfg_attr(not(feature = "burn-train"), allow(dead_code))]
pub(crate) fn norm_and_clip<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    clip: Option<&GradClip>,
) -> Option<f64> {
    let norm_type = clip.map_or(2.0, |clip| clip.norm_type);
    let norm = global_norm::<B, M>(model, grads, norm_type)?;
    if let Some(clip) = clip {
        let coefficient = clip.max_norm / (norm + 1e-6);
        if norm.is_finite() && coefficient < 1.0 {
            scale::<B, M>(model, grads, coefficient);
        }
    }
    Some(norm)
}

/// The module paths of the trainable parameters that have no gradient (MMCV's
/// `detect_anomalous_params`).
pub(crate) fn params_without_grad<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<String> {
    struct Present<'a> {
        grads: &'a GradientsParams,
        ids: std::collections::HashSet<burn::module::ParamId>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Present<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.grads.get::<B::InnerBackend, D>(param.id).is_some() {
                self.ids.insert(param.id);
            }
        }
    }
    let mut present = Present {
        grads,
        ids: Default::default(),
    };
    model.visit(&mut present);
    params_without::<B, M>(model, &|id| present.ids.contains(&id))
}

/// The module paths of the trainable parameters for which `has` is false.
pub(crate) fn params_without<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    has: &dyn Fn(burn::module::ParamId) -> bool,
) -> Vec<String> {
    struct Find<'a> {
        has: &'a dyn Fn(burn::module::ParamId) -> bool,
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
            if trainable && !(self.has)(param.id) {
                self.missing.push(self.path.join("."));
            }
        }
    }
    let mut find = Find {
        has,
        path: Vec::new(),
        missing: Vec::new(),
    };
    model.visit(&mut find);
    find.missing
}
