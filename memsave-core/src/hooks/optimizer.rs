//! The optimizer hook: backward and step, composed of a *precision* part (fp32, or half
//! precision with a loss scaler and fp32 master weights) and a *grouping* part (step every
//! `cumulative_iters` iterations; 1: every one). MMCV's four hooks are its four corners:
//!
//! | | every iteration | groups of `cumulative_iters` |
//! |---|---|---|
//! | fp32 | [`OptimizerHook::new`] | [`GradientCumulativeOptimizerHook::new`] |
//! | half | [`Fp16OptimizerHook::new`] | [`GradientCumulativeFp16OptimizerHook::new`] |
//!
//! Each iteration: backward of `loss / factor` (times the loss scale in half precision), its
//! gradients added to the group's (in the backward pass itself, see
//! [`crate::train::grads::backward`]); at a group's end: unscale, overflow check (half
//! precision), clip, step or skip, update the scaler.

use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use crate::fp16::{wrap_fp16_model, Precision};
use crate::memory;
use crate::scaler::LossScaler;
use crate::train::grads::{self, GradClip};
use crate::train::params::has_batch_norm;
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// Backward, optional global-norm clipping, step (MMCV's `OptimizerHook`), in fp32 or half
/// precision, every iteration or in groups (see the [module docs](self)).
#[derive(Debug)]
pub struct OptimizerHook {
    /// Clip the gradients by their global norm before each step (after unscaling).
    pub grad_clip: Option<GradClip>,
    /// Report every trainable parameter that got no gradient, by its module path.
    pub detect_anomalous_params: bool,
    mixed: Option<Mixed>,
    groups: Groups,
    /// The gradients of the current group so far.
    summed: Option<GradientsParams>,
    /// Micro-batches summed in the current group.
    pending: usize,
}

/// The precision part under mixed precision: the scaler, and the half type of the forward copy.
#[derive(Clone, Debug)]
struct Mixed {
    scaler: LossScaler,
    precision: Precision,
}

/// The grouping part: micro-batches per optimizer step, and MMCV's loss factor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Groups {
    cumulative_iters: usize,
}

impl Groups {
    /// Steps every `cumulative_iters` iterations; 0 is an error naming `cumulative_iters`.
    pub fn new(cumulative_iters: usize) -> Result<Self> {
        if cumulative_iters == 0 {
            return Err(Error::invalid(
                "cumulative_iters",
                "must be a positive integer, got 0",
            ));
        }
        Ok(Groups { cumulative_iters })
    }

    /// Micro-batches per step.
    pub fn cumulative_iters(self) -> usize {
        self.cumulative_iters
    }

    /// What the loss of iteration `iter` is divided by: `cumulative_iters` in the full groups,
    /// the size of the final short group in it (REFERENCE.md section 2).
    pub fn loss_factor(self, iter: usize, max_iters: usize) -> usize {
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
        if self.cumulative_iters == 1 {
            return;
        }
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
        if has_batch_norm::<B, M>(&state.model) {
            state.warn(format!(
                "the model has BatchNorm layers: with cumulative_iters = {}, their batch \
                 statistics see one micro-batch at a time, which may lower the result slightly",
                self.cumulative_iters
            ));
        }
    }
}

impl Default for OptimizerHook {
    fn default() -> Self {
        Self::new()
    }
}

impl OptimizerHook {
    /// fp32, a step every iteration, no clipping (MMCV's `OptimizerHook()`).
    pub fn new() -> Self {
        OptimizerHook {
            grad_clip: None,
            detect_anomalous_params: false,
            mixed: None,
            groups: Groups {
                cumulative_iters: 1,
            },
            summed: None,
            pending: 0,
        }
    }

    /// The same hook clipping the gradients by their global norm.
    pub fn with_grad_clip(mut self, grad_clip: Option<GradClip>) -> Self {
        self.grad_clip = grad_clip;
        self
    }

    /// The same hook reporting parameters without gradient.
    pub fn with_detect_anomalous_params(mut self, on: bool) -> Self {
        self.detect_anomalous_params = on;
        self
    }

    /// The same hook in mixed precision with `scaler`, the forward running on a `precision`
    /// copy of the weights (fp32 masters kept).
    pub fn with_mixed_precision(mut self, scaler: LossScaler, precision: Precision) -> Self {
        self.mixed = Some(Mixed { scaler, precision });
        self
    }

    /// The same hook stepping every `cumulative_iters` iterations.
    pub fn with_groups(mut self, groups: Groups) -> Self {
        self.groups = groups;
        self
    }

    /// The half type of the forward copy under mixed precision.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        if let Some(mixed) = &mut self.mixed {
            mixed.precision = precision;
        }
        self
    }

    /// The loss scaler, under mixed precision.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.mixed.as_ref().map(|mixed| &mixed.scaler)
    }

    /// The grouping.
    pub fn groups(&self) -> Groups {
        self.groups
    }

    /// The divisor of iteration `iter`'s loss in a run of `max_iters` iterations.
    pub fn loss_factor(&self, iter: usize, max_iters: usize) -> usize {
        self.groups.loss_factor(iter, max_iters)
    }

    /// The end of a group: unscale (half precision), check for overflow, clip, step or skip.
    fn step<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
        mut grads: GradientsParams,
    ) -> Result<()> {
        if let Some(collective) = state.collective.clone() {
            // Data parallel: the mean over the peers, once per group, before anything reads
            // the gradients (the norm, the overflow check, clipping); every peer gets the same
            // bits.
            let device = inner_device::<B>(&state.device);
            crate::dist::all_reduce_grads::<B, M>(&*collective, &state.model, &mut grads, &device)?;
        }
        if self.detect_anomalous_params {
            let missing = grads::params_without_grad::<B, M>(&state.model, &grads);
            if !missing.is_empty() {
                state.warn(format!(
                    "iteration {}: these trainable parameters got no gradient (not used in the \
                     loss): {}",
                    state.iter,
                    missing.join(", ")
                ));
            }
        }
        let Some(mixed) = &mut self.mixed else {
            state.log.grad_norm =
                grads::norm_and_clip::<B, M>(&state.model, &mut grads, self.grad_clip.as_ref());
            state.step(grads);
            return Ok(());
        };
        // The gradients are still half (one micro-batch) or fp32 sums (accumulation), and
        // scaled. Their norm is taken as they are and unscaled after (the same value, for a
        // power-of-two scale); each group of parameters is then cast, unscaled and clipped just
        // before it steps, in the order a full fp32 copy would have been.
        let scale = mixed.scaler.loss_scale();
        let norm_type = self.grad_clip.as_ref().map_or(2.0, |clip| clip.norm_type);
        let norm = grads::global_norm::<B, M>(&state.model, &grads, norm_type).map(|n| n / scale);
        let mut overflow = norm.is_some_and(|norm| !norm.is_finite());
        if let Some(collective) = &state.collective {
            // One non-finite gradient on any peer skips the step on every peer.
            let device = inner_device::<B>(&state.device);
            overflow = crate::dist::agree_any(&**collective, overflow, &device)?;
        }
        if overflow {
            mixed.scaler.update_scale(true);
            state.warn(format!(
                "iteration {}: gradient overflow (inf or NaN) at loss scale {scale}; the step is \
                 skipped and the loss scale lowered to {}",
                state.iter,
                mixed.scaler.loss_scale()
            ));
        } else {
            state.log.grad_norm = norm;
            let clip = match (&self.grad_clip, norm) {
                (Some(clip), Some(norm)) => Some(clip.max_norm / (norm + 1e-6)),
                _ => None,
            }
            .filter(|&coefficient| coefficient < 1.0);
            state.step_with(grads, &mut |model, group| {
                grads::to_f32::<B, M>(model, group);
                grads::scale::<B, M>(model, group, 1.0 / scale);
                if let Some(coefficient) = clip {
                    grads::scale::<B, M>(model, group, coefficient);
                }
            });
            // The old half copy goes before the new one is made.
            state.forward_model = None;
            state.forward_model = Some(memory::scope(memory::phase::HALF_WEIGHTS, || {
                wrap_fp16_model(state.model.clone(), mixed.precision)
            }));
            mixed.scaler.update_scale(false);
        }
        state.log.loss_scale = Some(mixed.scaler.loss_scale());
        Ok(())
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for OptimizerHook {
    fn name(&self) -> &'static str {
        match (&self.mixed, self.groups.cumulative_iters > 1) {
            (None, false) => "optimizer",
            (None, true) => "cumulative",
            (Some(_), false) => "fp16",
            (Some(_), true) => "cumulative_fp16",
        }
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.groups.warn(state);
        if let Some(mixed) = &self.mixed {
            state.forward_model = Some(memory::scope(memory::phase::HALF_WEIGHTS, || {
                wrap_fp16_model(state.model.clone(), mixed.precision)
            }));
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let Some(loss) = state.loss.take() else {
            return Ok(());
        };
        state.log.loss = Some(grads::scalar(&loss));
        if let Some(collective) = &state.collective {
            // The log shows the mean over the peers (MMDetection's `_parse_losses`).
            let mut values: Vec<f64> = std::iter::once(state.log.loss.unwrap_or(0.0))
                .chain(state.log.parts.iter().map(|(_, value)| *value))
                .collect();
            let device = inner_device::<B>(&state.device);
            crate::dist::mean_for_log(&**collective, &mut values, &device)?;
            state.log.loss = values.first().copied();
            for ((_, part), value) in state.log.parts.iter_mut().zip(&values[1..]) {
                *part = *value;
            }
        }
        let divisor = self.groups.loss_factor(state.iter, state.max_iters) as f64;
        let summed = self.summed.take();
        let grads = memory::scope(memory::phase::BACKWARD, || match &self.mixed {
            // fp32: the group's sums start the backward pass, no second set is made.
            None => grads::backward::<B, M>(loss.div_scalar(divisor), &state.model, summed),
            // Half: the forward copy's gradients are half and scaled, the sums fp32.
            Some(mixed) => {
                let scale = mixed.scaler.loss_scale();
                let loss = loss.cast(DType::F32).mul_scalar(scale / divisor);
                let grads = grads::backward::<B, M>(loss, state.forward_model(), None);
                match summed {
                    // Each half gradient is cast as it is added to its fp32 sum.
                    Some(mut summed) => {
                        grads::accumulate::<B, M>(&state.model, &mut summed, grads);
                        summed
                    }
                    // Half: cast at the step, group by group, or below as a group's first sums.
                    None => grads,
                }
            }
        });
        crate::checkpoint::profile::boundary(crate::checkpoint::profile::Boundary::BackwardEnd);
        self.pending += 1;
        if self.groups.boundary(state) {
            self.pending = 0;
            memory::scope(memory::phase::STEP, || self.step(state, grads))?;
        } else {
            let mut grads = grads;
            if self.mixed.is_some() {
                // The group's first sums, in fp32.
                memory::scope(memory::phase::BACKWARD, || {
                    grads::to_f32::<B, M>(&state.model, &mut grads)
                });
            }
            self.summed = Some(grads);
            if let Some(mixed) = &self.mixed {
                state.log.loss_scale = Some(mixed.scaler.loss_scale());
            }
        }
        Ok(())
    }

    fn precision(&self) -> Option<String> {
        Some(match &self.mixed {
            None => "fp32".to_string(),
            Some(mixed) => mixed.precision.to_string(),
        })
    }

    fn state_dict(&self) -> Option<serde_json::Value> {
        let groups = (self.groups.cumulative_iters > 1).then(|| {
            serde_json::json!({
                "cumulative_iters": self.groups.cumulative_iters,
                "pending": self.pending,
            })
        });
        let scaler = self.mixed.as_ref().map(|mixed| &mixed.scaler);
        match (groups, scaler) {
            (None, None) => None,
            (Some(groups), None) => Some(groups),
            (None, Some(scaler)) => serde_json::to_value(scaler).ok(),
            (Some(groups), Some(scaler)) => Some(serde_json::json!({
                "groups": groups,
                "loss_scaler": scaler,
            })),
        }
    }

    fn load_state_dict(&mut self, value: serde_json::Value) -> Result<()> {
        let Some(mixed) = &mut self.mixed else {
            return Ok(());
        };
        let (scaler, prefix) = if self.groups.cumulative_iters > 1 {
            let scaler = value
                .get("loss_scaler")
                .cloned()
                .ok_or_else(|| Error::invalid("loss_scaler", "missing"))?;
            (scaler, "loss_scaler.")
        } else {
            (value, "")
        };
        mixed.scaler = LossScaler::from_state(scaler).map_err(|error| match error {
            Error::InvalidValue { field, message } => {
                Error::invalid(format!("{prefix}{field}"), message)
            }
            other => other,
        })?;
        Ok(())
    }
}

/// The inner backend's device of an autodiff device (the same device).
fn inner_device<B: AutodiffBackend>(device: &B::Device) -> burn::tensor::Device<B::InnerBackend> {
    burn::tensor::Tensor::<B, 1>::empty([0], device)
        .inner()
        .device()
}

/// MMCV's `Fp16OptimizerHook`: mixed precision with fp32 master weights and loss scaling, a
/// step every iteration. Before the run the forward model becomes a half copy of the weights
/// (`wrap_fp16_model`); each iteration back-propagates `loss * scale` through it, casts the half
/// gradients onto the fp32 weights and divides them by the scale; on any inf or NaN the step is
/// skipped (weights and optimizer state untouched) and the scale backs off, else the gradients
/// are clipped, the fp32 weights step and the half copy is refreshed.
pub struct Fp16OptimizerHook;

impl Fp16OptimizerHook {
    /// The hook, in f16 (`with_precision` for bf16).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(loss_scaler: LossScaler) -> OptimizerHook {
        OptimizerHook::new().with_mixed_precision(loss_scaler, Precision::F16)
    }

    /// MMCV's default: a static scale of 512.
    #[allow(clippy::should_implement_trait)]
    pub fn default() -> OptimizerHook {
        Self::new(LossScaler::fixed(512.0).expect("512 is a valid scale"))
    }
}

/// MMCV's `GradientCumulativeOptimizerHook`: each iteration back-propagates `loss / factor`
/// and adds the gradients up; the optimizer steps every `cumulative_iters` iterations and at
/// the last one. Batch 1 with `cumulative_iters = 3` trains like batch 3 without (no
/// BatchNorm, same data).
pub struct GradientCumulativeOptimizerHook;

impl GradientCumulativeOptimizerHook {
    /// Steps every `cumulative_iters` iterations; 0 is an error.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(cumulative_iters: usize) -> Result<OptimizerHook> {
        Ok(OptimizerHook::new().with_groups(Groups::new(cumulative_iters)?))
    }
}

/// MMCV's `GradientCumulativeFp16OptimizerHook`: accumulation under mixed precision; each
/// iteration back-propagates `scale * loss / factor` through the half copy; at each group's end
/// the summed gradients are unscaled and checked, then clipped and stepped, or the step is
/// skipped and the scale backs off.
pub struct GradientCumulativeFp16OptimizerHook;

impl GradientCumulativeFp16OptimizerHook {
    /// Steps every `cumulative_iters` iterations; 0 is an error.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(cumulative_iters: usize, loss_scaler: LossScaler) -> Result<OptimizerHook> {
        Ok(Fp16OptimizerHook::new(loss_scaler).with_groups(Groups::new(cumulative_iters)?))
    }
}
