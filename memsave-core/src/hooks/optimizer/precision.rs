//! The precision part: fp32, or half precision with a loss scaler and fp32 master weights (the
//! forward runs on a half copy of them, made again after each step).

use std::path::Path;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use super::Groups;
use crate::fp16::{wrap_fp16_model, Precision};
use crate::memory;
use crate::scaler::LossScaler;
use crate::train::{TrainModel, TrainState};
use crate::{Error, Result};

/// The precision part under mixed precision: the scaler, and the half type of the forward copy.
#[derive(Clone, Debug)]
pub(super) struct Mixed {
    pub(super) scaler: LossScaler,
    pub(super) precision: Precision,
}

impl Mixed {
    /// The half copy the forward runs on, made afresh from the fp32 weights: the old copy goes
    /// before the new one is made.
    pub(super) fn refresh_forward<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &mut TrainState<B, M>,
    ) {
        state.forward_model = None;
        state.forward_model = Some(memory::scope(memory::phase::HALF_WEIGHTS, || {
            wrap_fp16_model(state.model.clone(), self.precision)
        }));
    }

    /// A step skipped because a gradient overflowed (inf or NaN) on some peer: the scale backs
    /// off, with MMCV's warning (and, at the run's first step, advice on the initial scale).
    pub(super) fn skip_overflow<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) {
        let scale = self.scaler.loss_scale();
        if let Some(advice) = self.scaler.first_overflow_advice(true) {
            state.warn(advice);
        }
        self.scaler.update_scale(true);
        state.log.overflow = true;
        state.warn(format!(
            "iteration {}: gradient overflow (inf or NaN) at loss scale {scale}; the step is \
             skipped and the loss scale lowered to {}",
            state.iter,
            self.scaler.loss_scale()
        ));
        state.log.loss_scale = Some(self.scaler.loss_scale());
    }

    /// After a step: the scale grows on MMCV's schedule, and the log shows it.
    pub(super) fn stepped<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) {
        self.scaler.update_scale(false);
        state.log.loss_scale = Some(self.scaler.loss_scale());
    }
}

/// The loss backward starts from: divided by MMCV's loss factor, and scaled (in fp32) under
/// mixed precision.
pub(super) fn loss_to_backward<B: AutodiffBackend, M: TrainModel<B>>(
    mixed: Option<&Mixed>,
    groups: Groups,
    state: &TrainState<B, M>,
    loss: Tensor<B, 1>,
) -> Tensor<B, 1> {
    let divisor = groups.loss_factor(state.iter, state.max_iters) as f64;
    match mixed {
        None => loss.div_scalar(divisor),
        Some(mixed) => loss
            .cast(DType::F32)
            .mul_scalar(mixed.scaler.loss_scale() / divisor),
    }
}

/// Before the run, under mixed precision: the model must be fp32 (the masters), and the half
/// copy the forward runs on is made.
pub(super) fn before_run<B: AutodiffBackend, M: TrainModel<B>>(
    mixed: Option<&Mixed>,
    state: &mut TrainState<B, M>,
) -> Result<()> {
    let Some(mixed) = mixed else {
        return Ok(());
    };
    if let Some(half) = crate::train::params::first_half_param::<B, M>(&state.model) {
        return Err(Error::invalid(
            "model",
            format!(
                "the runner was given a model already in half precision (`{half}` is half): \
                 under mixed precision the optimizer hook keeps the weights in fp32 as the \
                 masters and makes the half copy for the forward itself. Pass the fp32 model, \
                 without `wrap_fp16_model`"
            ),
        ));
    }
    state.forward_model = Some(memory::scope(memory::phase::HALF_WEIGHTS, || {
        wrap_fp16_model(state.model.clone(), mixed.precision)
    }));
    Ok(())
}

/// A snapshot of another precision loads (its weights are fp32), with a warning that says what
/// becomes of the loss scaler.
pub(super) fn after_load<B: AutodiffBackend, M: TrainModel<B>>(
    now: &str,
    saved: Option<&String>,
    state: &mut TrainState<B, M>,
    path: &Path,
) {
    let Some(saved) = saved.filter(|saved| *saved != now) else {
        return;
    };
    let scaler = if now == "fp32" {
        "its loss scaler is dropped"
    } else if saved == "fp32" {
        "the loss scaler starts afresh at its `init_scale`"
    } else {
        "the loss scaler carries on"
    };
    state.warn(format!(
        "checkpoint {} was trained in {saved}, and this config trains in {now}: the weights load \
         (they are kept in fp32), {scaler}; set `[fp16]` as the run that wrote it did to resume \
         it exactly",
        path.display()
    ));
}
