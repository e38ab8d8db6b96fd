use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use crate::train::optim::{global_norm, params_without_grad, scale_grads};
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// Gradient clipping by the global norm over all parameters (PyTorch's `clip_grad_norm_`, as
/// MMCV's `grad_clip = dict(max_norm=35, norm_type=2)`); Burn's own clipping is per tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradClip {
    /// The largest global norm allowed.
    pub max_norm: f64,
    /// The norm's `p` (2 by default; `f64::INFINITY` for the largest magnitude).
    pub norm_type: f64,
}

impl GradClip {
    /// Checks the values: a positive `max_norm`, a `norm_type` of at least 1.
    pub fn new(max_norm: f64, norm_type: f64) -> Result<Self> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(Error::invalid(
                "optimizer_config.grad_clip.max_norm",
                format!("must be a positive number, got {max_norm}"),
            ));
        }
        if norm_type.is_nan() || norm_type < 1.0 {
            return Err(Error::invalid(
                "optimizer_config.grad_clip.norm_type",
                format!("must be at least 1 (or inf), got {norm_type}"),
            ));
        }
        Ok(GradClip {
            max_norm,
            norm_type,
        })
    }
}

/// The global 2-norm of `grads` (or `clip`'s norm), clipping them to `clip.max_norm`. The norm
/// before clipping is returned (for the log, and as the overflow test: it is not finite when a
/// gradient is inf or NaN).
pub(crate) fn norm_and_clip<B: AutodiffBackend, M: TrainModel<B>>(
    model: &M,
    grads: &mut GradientsParams,
    clip: Option<&GradClip>,
) -> Option<f64> {
    let norm_type = clip.map_or(2.0, |clip| clip.norm_type);
    let norm = global_norm::<B, M>(model, grads, norm_type)?;
    if let Some(clip) = clip {
        let coefficient = clip.max_norm / (norm + 1e-6);
        if norm.is_finite() && coefficient < 1.0 {
            scale_grads::<B, M>(model, grads, coefficient);
        }
    }
    Some(norm)
}

/// Backward, optional global-norm clipping, step (MMCV's `OptimizerHook`).
#[derive(Clone, Debug, Default)]
pub struct OptimizerHook {
    /// Clip the gradients by their global norm before the step.
    pub grad_clip: Option<GradClip>,
    /// Report every trainable parameter that got no gradient, by its module path.
    pub detect_anomalous_params: bool,
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for OptimizerHook {
    fn name(&self) -> &'static str {
        "optimizer"
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let Some(loss) = state.loss.take() else {
            return Ok(());
        };
        state.log.loss = Some(scalar(&loss));
        let grads = GradientsParams::from_grads(loss.backward(), &state.model);
        crate::checkpoint::join_helpers();
        clip_and_step(
            state,
            grads,
            self.grad_clip.as_ref(),
            self.detect_anomalous_params,
        );
        Ok(())
    }
}

/// Reports parameters without gradient (if asked), clips, logs the norm and steps: the end of
/// every fp32 optimizer hook.
pub(crate) fn clip_and_step<B: AutodiffBackend, M: TrainModel<B>>(
    state: &mut TrainState<B, M>,
    mut grads: GradientsParams,
    clip: Option<&GradClip>,
    detect_anomalous_params: bool,
) {
    if detect_anomalous_params {
        report_params_without_grad::<B, M>(state, &grads);
    }
    state.log.grad_norm = norm_and_clip::<B, M>(&state.model, &mut grads, clip);
    state.step(grads);
}

/// The value of a one-element tensor.
pub(crate) fn scalar<B: AutodiffBackend>(loss: &burn::prelude::Tensor<B, 1>) -> f64 {
    use burn::tensor::ElementConversion;
    loss.clone()
        .cast(burn::tensor::DType::F32)
        .into_scalar()
        .elem::<f32>() as f64
}

pub(crate) fn report_params_without_grad<B: AutodiffBackend, M: TrainModel<B>>(
    state: &mut TrainState<B, M>,
    grads: &GradientsParams,
) {
    let missing = params_without_grad::<B, M>(&state.model, grads);
    if !missing.is_empty() {
        state.warn(format!(
            "iteration {}: these trainable parameters got no gradient (not used in the loss): {}",
            state.iter,
            missing.join(", ")
        ));
    }
}
