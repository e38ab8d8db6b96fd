//! The global norm of the gradients and clipping by it.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use super::map::scale;
use super::scalar;

pub use memsave_common::clip::GradClip;

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
        // `max` may pass over a NaN on some backends; the sum cannot, and times zero it is 0,
        // or NaN where a value is inf or NaN: the overflow test reads this norm.
        let nan_if_not_finite = grad.clone().sum().mul_scalar(0.0);
        grad.abs().max().add(nan_if_not_finite)
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
            // `max_pair` keeps the finite side of a NaN: `part - part` (0, or NaN) keeps it.
            Some(total) if norm_type.is_infinite() => {
                let nan_if_not_finite = part.clone().sub(part.clone());
                total.max_pair(part).add(nan_if_not_finite)
            }
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
