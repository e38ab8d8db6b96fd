//! The losses of RetinaNet: sigmoid focal loss (Lin et al., 2017) and L1 on box deltas, as
//! sums that the head divides by the number of positives.

use burn::prelude::*;

/// The summed sigmoid focal loss of `logits` against 0/1 `targets` (same shape), each element
/// weighted by `weights` (broadcast along the last axis):
/// `FL = -alpha_t (1 - p_t)^gamma log(p_t)`, with `p_t = p` for targets 1 and `1 - p` for 0.
/// Computed stably from the logits (Burn's `log_sigmoid`), with its exact gradient, the focal
/// weight's included, as MMCV's `sigmoid_focal_loss`.
pub fn sigmoid_focal_loss<const D: usize>(
    logits: Tensor<D>,
    targets: Tensor<D>,
    weights: Tensor<D>,
    gamma: f32,
    alpha: f32,
) -> Tensor<1> {
    let p = burn::tensor::activation::sigmoid(logits.clone());
    // Binary cross-entropy with logits, `(1 - t) x - log(sigmoid(x))`: stable, and smooth at 0
    // (the `max(x, 0) + log(1 + e^-|x|)` form has kinks whose subgradients break it there).
    let one_minus_t = targets.clone().neg().add_scalar(1.0);
    let bce = one_minus_t.clone() * logits.clone() - burn::tensor::activation::log_sigmoid(logits);
    let pt = p.clone().neg().add_scalar(1.0) * targets.clone() + p * one_minus_t.clone();
    let alpha_t = targets.mul_scalar(alpha) + one_minus_t.mul_scalar(1.0 - alpha);
    let focal = if gamma == 0.0 {
        alpha_t
    } else if gamma == 2.0 {
        alpha_t * pt.clone() * pt
    } else {
        alpha_t * pt.powf_scalar(gamma)
    };
    (bce * focal * weights).sum()
}

/// The summed `|pred - target|`, each element weighted by `weights` (broadcast along the last
/// axis).
pub fn l1_loss<const D: usize>(
    pred: Tensor<D>,
    target: Tensor<D>,
    weights: Tensor<D>,
) -> Tensor<1> {
    ((pred - target).abs() * weights).sum()
}
