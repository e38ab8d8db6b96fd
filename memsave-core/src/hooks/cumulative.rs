use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use super::fp16::{load_scaler, refresh_half_copy, scaled_backward, unscale_and_step};
use super::optimizer::{clip_and_step, scalar, GradClip};
use crate::fp16::Precision;
use crate::scaler::LossScaler;
use crate::train::optim::{accumulate_grads, has_batch_norm};
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// The number of micro-batches between optimizer steps, and MMCV's loss factor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Groups {
    cumulative_iters: usize,
}

impl Groups {
    fn new(cumulative_iters: usize) -> Result<Self> {
        if cumulative_iters == 0 {
            return Err(Error::invalid(
                "optimizer_config.cumulative_iters",
                "must be a positive integer, got 0",
            ));
        }
        Ok(Groups { cumulative_iters })
    }

    /// What the loss of iteration `iter` is divided by: `cumulative_iters` in the full groups,
    /// the size of the final short group in it (REFERENCE.md section 2).
    fn loss_factor(self, iter: usize, max_iters: usize) -> usize {
        let remainder = max_iters % self.cumulative_iters;
        if iter < max_iters - remainder {
            self.cumulative_iters
        } else {
            remainder
        }
    }

    /// Whether the optimizer steps after iteration `state.iter`.
    fn boundary<B: AutodiffBackend, M: TrainModel<B>>(self, state: &TrainState<B, M>) -> bool {
        state.every_n_iters(self.cumulative_iters) || state.is_last_iter()
    }

    /// MMCV's two warnings, at the start of a run.
    fn warn<B: AutodiffBackend, M: TrainModel<B>>(self, state: &mut TrainState<B, M>) {
        if !state.iter.is_multiple_of(self.cumulative_iters) {
            state.warn(format!(
                "resuming at iteration {}, which is not a multiple of cumulative_iters ({}): the \
                 gradients of the first {} iterations of this group are lost, which may change \
                 the result slightly",
                state.iter,
                self.cumulative_iters,
                state.iter % self.cumulative_iters
            ));
        }
        if self.cumulative_iters > 1 && has_batch_norm::<B, M>(&state.model) {
            state.warn(format!(
                "the model has BatchNorm layers: with cumulative_iters = {}, their batch \
                 statistics see one micro-batch at a time, which may lower the result slightly",
                self.cumulative_iters
            ));
        }
    }

    /// The group size and how many micro-batches of the current group are summed but not yet
    /// stepped (not saved themselves: MMCV's semantics, with the warning on resume).
    fn state_dict(self, pending: usize) -> serde_json::Value {
        serde_json::json!({ "cumulative_iters": self.cumulative_iters, "pending": pending })
    }
}

/// Gradient accumulation (MMCV's `GradientCumulativeOptimizerHook`): each iteration
/// back-propagates `loss / factor` and adds the gradients up; the optimizer steps every
/// `cumulative_iters` iterations and at the last one. Batch 1 with `cumulative_iters = 3` trains
/// like batch 3 without (no BatchNorm, same data).
#[derive(Debug)]
pub struct GradientCumulativeOptimizerHook {
    groups: Groups,
    /// Clip the summed gradients by their global norm before each step.
    pub grad_clip: Option<GradClip>,
    /// Report trainable parameters that got no gradient.
    pub detect_anomalous_params: bool,
    summed: Option<GradientsParams>,
    pending: usize,
}

impl GradientCumulativeOptimizerHook {
    /// Steps every `cumulative_iters` iterations; 0 is an error.
    pub fn new(cumulative_iters: usize) -> Result<Self> {
        Ok(GradientCumulativeOptimizerHook {
            groups: Groups::new(cumulative_iters)?,
            grad_clip: None,
            detect_anomalous_params: false,
            summed: None,
            pending: 0,
        })
    }

    /// The divisor of iteration `iter`'s loss in a run of `max_iters` iterations.
    pub fn loss_factor(&self, iter: usize, max_iters: usize) -> usize {
        self.groups.loss_factor(iter, max_iters)
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for GradientCumulativeOptimizerHook {
    fn name(&self) -> &'static str {
        "cumulative"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.groups.warn(state);
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let Some(loss) = state.loss.take() else {
            return Ok(());
        };
        state.log.loss = Some(scalar(&loss));
        let factor = self.groups.loss_factor(state.iter, state.max_iters);
        let loss = loss.div_scalar(factor as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &state.model);
        crate::checkpoint::join_helpers();
        let summed = self.summed.get_or_insert_with(GradientsParams::new);
        accumulate_grads::<B, M>(&state.model, summed, grads);
        self.pending += 1;
        if self.groups.boundary(state) {
            self.pending = 0;
            let grads = self.summed.take().expect("summed above");
            clip_and_step(
                state,
                grads,
                self.grad_clip.as_ref(),
                self.detect_anomalous_params,
            );
        }
        Ok(())
    }

    fn state_dict(&self) -> Option<serde_json::Value> {
        Some(self.groups.state_dict(self.pending))
    }
}

/// Gradient accumulation under mixed precision (MMCV's `GradientCumulativeFp16OptimizerHook`):
/// each iteration back-propagates `scale * loss / factor` through the half copy; at each group
/// boundary the summed gradients are unscaled and checked, then clipped and stepped, or the
/// step is skipped and the scale backs off.
#[derive(Debug)]
pub struct GradientCumulativeFp16OptimizerHook {
    groups: Groups,
    /// The loss scale and its update rule.
    pub loss_scaler: LossScaler,
    /// Clip the summed, unscaled gradients by their global norm.
    pub grad_clip: Option<GradClip>,
    /// The half type of the forward copy.
    pub precision: Precision,
    /// Report trainable parameters that got no gradient.
    pub detect_anomalous_params: bool,
    summed: Option<GradientsParams>,
    pending: usize,
}

impl GradientCumulativeFp16OptimizerHook {
    /// Steps every `cumulative_iters` iterations; 0 is an error.
    pub fn new(cumulative_iters: usize, loss_scaler: LossScaler) -> Result<Self> {
        Ok(GradientCumulativeFp16OptimizerHook {
            groups: Groups::new(cumulative_iters)?,
            loss_scaler,
            grad_clip: None,
            precision: Precision::F16,
            detect_anomalous_params: false,
            summed: None,
            pending: 0,
        })
    }

    /// The divisor of iteration `iter`'s loss in a run of `max_iters` iterations.
    pub fn loss_factor(&self, iter: usize, max_iters: usize) -> usize {
        self.groups.loss_factor(iter, max_iters)
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for GradientCumulativeFp16OptimizerHook {
    fn name(&self) -> &'static str {
        "cumulative_fp16"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.groups.warn(state);
        refresh_half_copy::<B, M>(state, self.precision);
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let factor = self.groups.loss_factor(state.iter, state.max_iters) as f64;
        let scale = self.loss_scaler.loss_scale();
        let Some(grads) = scaled_backward::<B, M>(state, scale, factor) else {
            return Ok(());
        };
        let summed = self.summed.get_or_insert_with(GradientsParams::new);
        accumulate_grads::<B, M>(&state.model, summed, grads);
        self.pending += 1;
        if self.groups.boundary(state) {
            self.pending = 0;
            let grads = self.summed.take().expect("summed above");
            unscale_and_step::<B, M>(
                state,
                grads,
                &mut self.loss_scaler,
                self.grad_clip.as_ref(),
                self.precision,
                self.detect_anomalous_params,
            );
        } else {
            state.log.loss_scale = Some(scale);
        }
        Ok(())
    }

    fn state_dict(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "groups": self.groups.state_dict(self.pending),
            "loss_scaler": self.loss_scaler,
        }))
    }

    fn load_state_dict(&mut self, value: serde_json::Value) -> Result<()> {
        let scaler = value
            .get("loss_scaler")
            .cloned()
            .ok_or_else(|| Error::invalid("loss scaler state", "missing"))?;
        self.loss_scaler = load_scaler(scaler)?;
        Ok(())
    }
}
