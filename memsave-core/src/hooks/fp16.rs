use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;

use super::optimizer::{norm_and_clip, report_params_without_grad, scalar, GradClip};
use crate::fp16::{wrap_fp16_model, Precision};
use crate::scaler::LossScaler;
use crate::train::optim::map_grads;
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// Mixed precision with fp32 master weights and loss scaling (MMCV's `Fp16OptimizerHook`).
///
/// Before the run the forward model becomes a half copy of the weights (`wrap_fp16_model`); each
/// iteration back-propagates `loss * scale` through it, casts the half gradients onto the fp32
/// weights and divides them by the scale; on any inf or NaN the step is skipped (weights and
/// optimizer state untouched) and the scale backs off, else the gradients are clipped, the fp32
/// weights step and the half copy is refreshed.
#[derive(Clone, Debug)]
pub struct Fp16OptimizerHook {
    /// The loss scale and its update rule.
    pub loss_scaler: LossScaler,
    /// Clip the (unscaled) gradients by their global norm.
    pub grad_clip: Option<GradClip>,
    /// The half type of the forward copy.
    pub precision: Precision,
    /// Report trainable parameters that got no gradient.
    pub detect_anomalous_params: bool,
}

impl Fp16OptimizerHook {
    /// MMCV's defaults: a static scale of 512, f16.
    pub fn new(loss_scaler: LossScaler) -> Self {
        Fp16OptimizerHook {
            loss_scaler,
            grad_clip: None,
            precision: Precision::F16,
            detect_anomalous_params: false,
        }
    }
}

impl Default for Fp16OptimizerHook {
    fn default() -> Self {
        Self::new(LossScaler::fixed(512.0).expect("512 is a valid scale"))
    }
}

/// The half copy of the weights the forward runs on.
pub(crate) fn refresh_half_copy<B: AutodiffBackend, M: TrainModel<B>>(
    state: &mut TrainState<B, M>,
    precision: Precision,
) {
    state.forward_model = Some(wrap_fp16_model(state.model.clone(), precision));
}

/// Backward of `loss * scale / divisor` through the half copy; the gradients come back in fp32,
/// keyed like the fp32 weights, still scaled.
pub(crate) fn scaled_backward<B: AutodiffBackend, M: TrainModel<B>>(
    state: &mut TrainState<B, M>,
    scale: f64,
    divisor: f64,
) -> Option<GradientsParams> {
    let loss = state.loss.take()?;
    state.log.loss = Some(scalar(&loss));
    let scaled = loss.cast(DType::F32).mul_scalar(scale / divisor);
    let mut grads = GradientsParams::from_grads(scaled.backward(), state.forward_model());
    crate::checkpoint::join_helpers();
    map_grads::<B, M>(&state.model, &mut grads, &mut |grad| grad.cast(DType::F32));
    Some(grads)
}

/// Unscales, checks for overflow, clips and steps, or skips; then updates the scaler. Shared
/// by the plain and the accumulating fp16 hooks.
pub(crate) fn unscale_and_step<B: AutodiffBackend, M: TrainModel<B>>(
    state: &mut TrainState<B, M>,
    mut grads: GradientsParams,
    scaler: &mut LossScaler,
    clip: Option<&GradClip>,
    precision: Precision,
    detect_anomalous_params: bool,
) {
    if detect_anomalous_params {
        report_params_without_grad::<B, M>(state, &grads);
    }
    let scale = scaler.loss_scale();
    crate::train::optim::scale_grads::<B, M>(&state.model, &mut grads, 1.0 / scale);
    let norm = norm_and_clip::<B, M>(&state.model, &mut grads, clip);
    let overflow = norm.is_some_and(|norm| !norm.is_finite());
    if overflow {
        scaler.update_scale(true);
        state.warn(format!(
            "iteration {}: gradient overflow (inf or NaN) at loss scale {scale}; the step is \
             skipped and the loss scale lowered to {}",
            state.iter,
            scaler.loss_scale()
        ));
    } else {
        state.log.grad_norm = norm;
        state.step(grads);
        refresh_half_copy::<B, M>(state, precision);
        scaler.update_scale(false);
    }
    state.log.loss_scale = Some(scaler.loss_scale());
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for Fp16OptimizerHook {
    fn name(&self) -> &'static str {
        "fp16"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        refresh_half_copy::<B, M>(state, self.precision);
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let scale = self.loss_scaler.loss_scale();
        let Some(grads) = scaled_backward::<B, M>(state, scale, 1.0) else {
            return Ok(());
        };
        unscale_and_step::<B, M>(
            state,
            grads,
            &mut self.loss_scaler,
            self.grad_clip.as_ref(),
            self.precision,
            self.detect_anomalous_params,
        );
        Ok(())
    }

    fn state_dict(&self) -> Option<serde_json::Value> {
        serde_json::to_value(&self.loss_scaler).ok()
    }

    fn load_state_dict(&mut self, value: serde_json::Value) -> Result<()> {
        self.loss_scaler = load_scaler(value)?;
        Ok(())
    }
}

/// A loss scaler's state from a checkpoint.
pub(crate) fn load_scaler(value: serde_json::Value) -> Result<LossScaler> {
    serde_json::from_value(value)
        .map_err(|error| Error::invalid("loss scaler state", error.to_string()))
}
