//! The operations a mixed-precision step applies to its gradients, parameter by parameter:
//! unscaling onto fp32 master weights, scaling, the global norm
//! and clipping by it (PyTorch's `clip_grad_norm_`; Burn's own clipping is per tensor).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

pub use memsave_common::clip::GradClip;

/// Applies `f` to every gradient of `model`'s parameters in `grads`, in place (flattened).
fn map_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    f: &mut dyn FnMut(Tensor<1>) -> Tensor<1>,
) {
    struct Map<'a> {
        grads: &'a mut GradientsParams,
        f: &'a mut dyn FnMut(Tensor<1>) -> Tensor<1>,
    }
    impl ModuleVisitor for Map<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.remove::<D>(param.id) {
                let shape = grad.shape();
                let flat: Tensor<1> = grad.reshape([shape.num_elements()]);
                self.grads
                    .register::<D>(param.id, (self.f)(flat).reshape(shape));
            }
        }
    }
    model.visit(&mut Map { grads, f });
}

/// Multiplies every gradient by `factor` (unscaling: `1 / loss_scale`).
pub fn scale<M: Module>(model: &M, grads: &mut GradientsParams, factor: f64) {
    map_grads(model, grads, &mut |grad| grad.mul_scalar(factor));
}

/// Casts every gradient to its parameter's dtype in `model` (half gradients onto fp32 master
/// weights; a master kept in another dtype gets its own) and multiplies it by `factor` (unscaling:
/// `1 / loss_scale`), in one pass.
pub fn unscale_to_masters<M: Module>(model: &M, grads: &mut GradientsParams, factor: f64) {
    struct Unscale<'a>(&'a mut GradientsParams, f64);
    impl ModuleVisitor for Unscale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.remove::<D>(param.id) {
                let dtype: DType = param.val().dtype();
                self.0
                    .register::<D>(param.id, grad.cast(dtype).mul_scalar(self.1));
            }
        }
    }
    model.visit(&mut Unscale(grads, factor));
}

/// Adds `more` onto `sums`, each gradient of `model`'s parameters cast to its sum's dtype (the
/// fp32 sums of accumulation, MMCV's `.grad` that each micro-batch's backward adds to); a
/// parameter without a sum yet starts one in `dtype`, or its master's dtype.
pub fn accumulate<M: Module>(
    model: &M,
    sums: &mut GradientsParams,
    mut more: GradientsParams,
    dtype: Option<DType>,
) {
    struct Add<'a>(
        &'a mut GradientsParams,
        &'a mut GradientsParams,
        Option<DType>,
    );
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(grad) = self.1.remove::<D>(param.id) else {
                return;
            };
            let sum = match self.0.remove::<D>(param.id) {
                Some(sum) => {
                    let dtype = sum.dtype();
                    sum + grad.cast(dtype)
                }
                None => grad.cast(self.2.unwrap_or_else(|| param.val().dtype())),
            };
            self.0.register::<D>(param.id, sum);
        }
    }
    model.visit(&mut Add(sums, &mut more, dtype));
}

/// The `p`-norm of every gradient together (PyTorch's `clip_grad_norm_` total norm), in fp32;
/// `norm_type = inf` for the largest magnitude. `None` when there is no gradient. Not finite
/// when a gradient holds an inf or a NaN: the overflow test of mixed precision.
pub fn global_norm<M: Module>(model: &M, grads: &GradientsParams, norm_type: f64) -> Option<f64> {
    struct Parts<'a> {
        grads: &'a GradientsParams,
        norm: NormParts,
    }
    impl ModuleVisitor for Parts<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.get::<D>(param.id) {
                let part = norm_part(grad, self.norm.norm_type);
                self.norm.add(part);
            }
        }
    }
    let mut parts = Parts {
        grads,
        norm: NormParts::new(norm_type),
    };
    model.visit(&mut parts);
    parts.norm.finish()
}

/// One gradient's part of a `p`-norm (see [`global_norm`]): a one-element fp32 tensor.
pub(crate) fn norm_part<const D: usize>(grad: Tensor<D>, norm_type: f64) -> Tensor<1> {
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

/// Parts of a `p`-norm added up in the model's order: the same bits wherever the parts were
/// computed (after backward, or by the step in backward's taps).
pub(crate) struct NormParts {
    norm_type: f64,
    total: Option<Tensor<1>>,
}

impl NormParts {
    pub(crate) fn new(norm_type: f64) -> Self {
        NormParts {
            norm_type,
            total: None,
        }
    }

    /// Adds the next parameter's part.
    pub(crate) fn add(&mut self, part: Tensor<1>) {
        self.total = Some(match self.total.take() {
            None => part,
            // `max_pair` keeps the finite side of a NaN: `part - part` (0, or NaN) keeps it.
            Some(total) if self.norm_type.is_infinite() => {
                let nan_if_not_finite = part.clone().sub(part.clone());
                total.max_pair(part).add(nan_if_not_finite)
            }
            Some(total) => total + part,
        });
    }

    /// The norm (`None` without any part).
    pub(crate) fn finish(self) -> Option<f64> {
        let total = self.total?.into_scalar::<f32>() as f64;
        Some(if self.norm_type.is_infinite() {
            total
        } else {
            total.powf(1.0 / self.norm_type)
        })
    }
}

/// Clips `grads` by `clip` given their global norm `norm` (the clipping's `p`-norm, already
/// computed): scaled by `max_norm / (norm + 1e-6)` where that is below 1 and the norm finite.
pub fn clip_with_norm<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    clip: &GradClip,
    norm: f64,
) {
    if let Some(coefficient) = clip_coefficient(clip, norm) {
        scale(model, grads, coefficient);
    }
}

/// The factor [`clip_with_norm`] scales the gradients by, where it does.
pub(crate) fn clip_coefficient(clip: &GradClip, norm: f64) -> Option<f64> {
    let coefficient = clip.max_norm / (norm + 1e-6);
    (norm.is_finite() && coefficient < 1.0).then_some(coefficient)
}

/// The global norm of `grads` (`clip`'s `p`), clipping them to `clip.max_norm` (PyTorch's
/// coefficient `max_norm / (norm + 1e-6)`, applied when below 1). The norm before clipping is
/// returned; a norm that is not finite clips nothing.
pub fn clip_by_global_norm<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    clip: &GradClip,
) -> Option<f64> {
    let norm = global_norm(model, grads, clip.norm_type)?;
    clip_with_norm(model, grads, clip, norm);
    Some(norm)
}
