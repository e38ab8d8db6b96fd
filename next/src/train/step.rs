//! The end of a group of micro-batches, as MMCV orders it: the sums unscaled (mixed precision),
//! the global norm, the overflow check (skip the step, lower the scale), clipping, the step, the
//! scale updated. One engine for the runner's optimizer hook and burn-train's adapter, so that
//! both train the same bits.

use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;

use crate::grads::{self, GradClip};
use crate::scaler::{LossScaler, ScaleMode};

/// What a group's end did.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct GroupEnd {
    /// The optimizer stepped (no overflow).
    pub(crate) stepped: bool,
    /// A gradient held an inf or a NaN: the step was skipped.
    pub(crate) overflow: bool,
    /// The global norm of the unscaled gradients, before clipping.
    pub(crate) grad_norm: Option<f64>,
    /// The loss scale after its update, under mixed precision.
    pub(crate) loss_scale: Option<f64>,
    /// What to warn of (MMCV's overflow message, the first overflow's advice).
    pub(crate) warnings: Vec<String>,
}

/// Steps `optimizer` on `model` with the group's gradient sums `sums` (in `model`'s dtypes,
/// scaled by `scaler`'s scale under mixed precision), clipped by `clip`; or, where a gradient
/// overflowed, leaves `model` as it was and lowers the scale. `iter` is the micro-batch that
/// ends the group (the warning names it).
pub(crate) fn end_group<M: Module>(
    model: M,
    mut sums: GradientsParams,
    clip: Option<&GradClip>,
    scaler: Option<&mut LossScaler>,
    optimizer: &mut ModuleOptimizer,
    lr: impl Into<burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate>,
    iter: usize,
) -> (M, GroupEnd) {
    let norm_type = clip.map_or(2.0, |clip| clip.norm_type);
    let mut end = GroupEnd::default();
    if let Some(scaler) = scaler {
        let scale = scaler.loss_scale();
        grads::scale(&model, &mut sums, 1.0 / scale);
        end.grad_norm = grads::global_norm(&model, &sums, norm_type);
        if end.grad_norm.is_some_and(|norm| !norm.is_finite()) {
            skip_on_overflow(scaler, scale, iter, &mut end);
            return (model, end);
        }
        scaler.update_scale(false);
        end.loss_scale = Some(scaler.loss_scale());
    } else {
        end.grad_norm = grads::global_norm(&model, &sums, norm_type);
    }
    if let (Some(clip), Some(norm)) = (clip, end.grad_norm) {
        grads::clip_with_norm(&model, &mut sums, clip, norm);
    }
    end.stepped = true;
    (optimizer.step(lr, model, sums), end)
}

/// A group whose gradients overflowed at loss scale `scale`: the step skipped, the scale
/// lowered (MMCV's warning naming the micro-batch `iter`, the first overflow's advice).
pub(crate) fn skip_on_overflow(
    scaler: &mut LossScaler,
    scale: f64,
    iter: usize,
    end: &mut GroupEnd,
) {
    end.warnings.extend(scaler.first_overflow_advice(true));
    scaler.update_scale(true);
    let after = match scaler.mode() {
        ScaleMode::Dynamic => format!("the loss scale lowered to {}", scaler.loss_scale()),
        ScaleMode::Static => "the loss scale is static and stays".to_string(),
    };
    end.warnings.push(format!(
        "iteration {iter}: gradient overflow (inf or NaN) at loss scale {scale}; the step is \
         skipped and {after}"
    ));
    end.overflow = true;
    end.stepped = false;
    end.loss_scale = Some(scaler.loss_scale());
}
