//! The optimizer hook on Burn 0.22: backward and step, composed of a *precision* part (fp32,
//! half precision with a loss scaler and fp32 masters, or 16-bit weights) and a *grouping* part
//! (step every `cumulative_iters` iterations; 1: every one). MMCV's four hooks are the four
//! corners of the two:
//!
//! | | every iteration | groups of `cumulative_iters` |
//! |---|---|---|
//! | fp32 | [`OptimizerHook::new`] | [`GradientCumulativeOptimizerHook::new`] |
//! | half | [`Fp16OptimizerHook::new`] | [`GradientCumulativeFp16OptimizerHook::new`] |
//!
//! Each iteration: backward of `loss / factor` (times the loss scale in half precision, the loss
//! in fp32), its gradients added to the group's sums; at a group's end: unscale, overflow check
//! (half precision), clip, step or skip, update the scaler (the engine burn-train's adapter
//! steps with too). The step runs after backward, or in it ([`OptimizerHook::with_step_in_backward`],
//! [`in_backward`]), on the device or on the host ([`OptimizerHook::with_optimizer_offload`],
//! [`offload`]); data-parallel reduction comes with a later slice of the port.

mod frozen;
mod in_backward;
mod mmcv;
mod offload;
mod sink;
mod tapped;
mod weights16;

pub use mmcv::{
    Fp16OptimizerHook, GradientCumulativeFp16OptimizerHook, GradientCumulativeOptimizerHook,
};

use std::path::Path;

use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::DType;

use crate::fp16::{wrap_fp16_model, Precision};
use crate::grads::{self, GradClip};
use crate::memory::{in_phase, phase, scope};
use crate::scaler::LossScaler;
use crate::snapshot::SnapshotMeta;
use crate::train::params::{first_half_param, has_batch_norm, params_without_grad};
use crate::train::step::end_group;
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

pub use memsave_common::groups::Groups;

/// The precision part under mixed precision or 16-bit weights.
#[derive(Clone, Debug)]
struct Mixed {
    scaler: LossScaler,
    precision: Precision,
    /// The forward runs on the weights themselves (16-bit weights of the forward's type).
    on_weights: bool,
    /// Not asked for: 16-bit weights without mixed precision run their forward in their own
    /// type (the hook keeps its fp32 name).
    implied: bool,
}

impl Mixed {
    /// The scale the log shows: none for bf16 weights without mixed precision (a constant 1).
    fn logged_scale(&self) -> Option<f64> {
        let constant = self.implied && self.precision == Precision::Bf16;
        (!constant).then(|| self.scaler.loss_scale())
    }
}

/// Backward, optional global-norm clipping, step (MMCV's `OptimizerHook`), in fp32 or half
/// precision, every iteration or in groups (see the module docs).
#[derive(Debug)]
pub struct OptimizerHook {
    /// Clip the gradients by their global norm before each step (after unscaling).
    pub grad_clip: Option<GradClip>,
    /// Report every trainable parameter that got no gradient, by its module path.
    pub detect_anomalous_params: bool,
    mixed: Option<Mixed>,
    /// The trainable weights are kept in this 16-bit type (the optimizer a per-weight rule
    /// wrapped by `Weights16`).
    weights16: Option<Precision>,
    groups: Groups,
    /// The gradients of the current group so far (fp32 under mixed precision, scaled).
    summed: Option<GradientsParams>,
    /// Micro-batches summed in the current group.
    pending: usize,
    /// A resumed snapshot's state of this hook, kept until the run starts where 16-bit
    /// weights imply the loss scaler it holds.
    saved_state: Option<serde_json::Value>,
    /// The step in backward, where it is on.
    in_backward: Option<tapped::StepInBackward>,
    /// The type frozen weights are held in, where they are compressed.
    frozen: Option<crate::frozen::FrozenDtype>,
    /// Optimizer offload, where it is on.
    offload: Option<offload::OptimizerOffload>,
    /// Whether a step of the 16-bit weights was counted in this run (the first one warns).
    rounding_counted: bool,
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
            weights16: None,
            groups: Groups::EVERY_ITERATION,
            summed: None,
            pending: 0,
            saved_state: None,
            in_backward: None,
            frozen: None,
            offload: None,
            rounding_counted: false,
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
    /// copy of the weights (fp32 masters kept, MMCV's `Fp16OptimizerHook`).
    pub fn with_mixed_precision(mut self, scaler: LossScaler, precision: Precision) -> Self {
        self.mixed = Some(Mixed {
            scaler,
            precision,
            on_weights: false,
            implied: false,
        });
        self
    }

    /// The same hook for 16-bit weights: before the run the model is cast to `precision` (its
    /// normalisation layers and `#[fp16(fp32)]` islands kept fp32, as `wrap_fp16_model` does)
    /// and the forward runs on the weights, with no fp32 copy anywhere. The optimizer must
    /// widen each weight for its step (`memsave_next::weights16::Weights16`). Without mixed
    /// precision the loss is scaled as the type needs: f16 with a dynamic scale from 2^16,
    /// bf16 not at all.
    pub fn with_weights16(mut self, precision: Precision) -> Self {
        self.weights16 = Some(precision);
        self
    }

    /// The same hook stepping every `cumulative_iters` iterations.
    pub fn with_groups(mut self, groups: Groups) -> Self {
        self.groups = groups;
        self
    }

    /// The precision the forward runs in (`"fp32"`, `"f16"`, `"bf16"`): written in
    /// snapshots, compared on resume.
    pub fn precision(&self) -> String {
        match (&self.mixed, self.weights16) {
            (Some(mixed), _) => mixed.precision.to_string(),
            (None, Some(precision)) => precision.to_string(),
            (None, None) => "fp32".to_string(),
        }
    }

    /// The loss scaler, under mixed precision.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.mixed.as_ref().map(|mixed| &mixed.scaler)
    }

    /// The grouping.
    pub fn groups(&self) -> Groups {
        self.groups
    }

    /// Before the run: the model fp32, cast to its 16-bit type where the weights are kept in
    /// one, and the half copy made where the forward runs on one.
    fn prepare<M: TrainModel>(&mut self, state: &mut TrainState<M>) -> Result<()> {
        if self.mixed.is_none() && self.weights16.is_none() {
            return Ok(());
        }
        if let Some(half) = first_half_param(&state.model) {
            let keeper = if self.weights16.is_some() {
                "with 16-bit weights the optimizer hook casts the weights to their type itself"
            } else {
                "under mixed precision the optimizer hook keeps the weights in fp32 as the \
                 masters and makes the half copy for the forward itself"
            };
            return Err(Error::invalid(
                "model",
                format!(
                    "the runner was given a model already in half precision (`{half}` is half): \
                     {keeper}. Pass the fp32 model, without `wrap_fp16_model`"
                ),
            ));
        }
        if let Some(precision) = self.weights16 {
            if let Some(mixed) = self.mixed.as_ref().filter(|m| m.precision != precision) {
                return Err(Error::invalid(
                    "precision",
                    format!(
                        "the weights are kept in {precision} and mixed precision asks for a \
                         forward in {}: on Burn 0.22 the forward runs on the weights \
                         themselves; ask for {precision} or leave mixed precision out",
                        mixed.precision
                    ),
                ));
            }
            state.model = wrap_fp16_model(state.model.clone(), precision);
            let mixed = self
                .mixed
                .get_or_insert_with(|| weights16::implied(precision));
            mixed.on_weights = true;
        }
        self.refresh_forward(state);
        Ok(())
    }

    /// The half copy the forward runs on, made afresh from the fp32 weights (the old copy goes
    /// before the new one is made).
    fn refresh_forward<M: TrainModel>(&self, state: &mut TrainState<M>) {
        if self.offloaded() {
            // The half copy is the model, stepped in place.
            return;
        }
        let Some(mixed) = self.mixed.as_ref().filter(|mixed| !mixed.on_weights) else {
            return;
        };
        state.forward_model = None;
        let copy = scope(phase::HALF_WEIGHTS, || {
            wrap_fp16_model(state.model.clone(), mixed.precision)
        });
        state.forward_model = Some(copy);
    }

    /// The iteration's loss as back-propagated: divided by MMCV's factor (and scaled in fp32
    /// under mixed precision); the loss logged.
    fn scaled_loss<M: TrainModel>(&self, state: &mut TrainState<M>) -> Option<Tensor<1>> {
        let loss = state.loss.take()?;
        state.log.loss = Some(crate::train::scalar(&loss));
        let divisor = self.groups.loss_factor(state.iter, state.max_iters) as f64;
        Some(match &self.mixed {
            None => loss.div_scalar(divisor),
            // MMCV's order: the loss divided by its factor, then scaled; in fp32 (a half loss's
            // own gradient, the scale, would overflow f16).
            Some(mixed) => loss
                .cast(DType::F32)
                .div_scalar(divisor)
                .mul_scalar(mixed.scaler.loss_scale()),
        })
    }

    /// The iteration's backward: the loss divided by MMCV's factor (and scaled in fp32 under
    /// mixed precision), its gradients added to the group's sums.
    fn backward<M: TrainModel>(&mut self, state: &mut TrainState<M>) -> Option<GradientsParams> {
        let loss = self.scaled_loss(state)?;
        let grads = in_phase(phase::BACKWARD, || {
            GradientsParams::from_grads(crate::checkpoint::backward(loss), state.forward_model())
        });
        // The sums in the masters' dtype (fp32 under mixed precision); with 16-bit weights fp32
        // all the same (the optimizer widens each weight for its step).
        let mut sums = self.summed.take().unwrap_or_default();
        let dtype = self.weights16.map(|_| DType::F32);
        grads::accumulate(&state.model, &mut sums, grads, dtype);
        self.pending += 1;
        Some(sums)
    }

    /// The end of a group: the step, or its skip on overflow.
    fn end_group<M: TrainModel>(
        &mut self,
        state: &mut TrainState<M>,
        sums: GradientsParams,
    ) -> Result<()> {
        self.pending = 0;
        if self.detect_anomalous_params {
            warn_no_gradient(state, params_without_grad(&state.model, &sums));
        }
        let scaler = self.mixed.as_mut().map(|mixed| &mut mixed.scaler);
        let (lr, iter) = (state.lr, state.iter);
        let model = state.model.clone();
        let clip = self.grad_clip.as_ref();
        let (model, end) = scope(phase::STEP, || {
            end_group(model, sums, clip, scaler, &mut state.optimizer, lr, iter)
        });
        state.model = model;
        for warning in end.warnings {
            state.warn(warning);
        }
        state.log.overflow = end.overflow;
        state.log.stepped = end.stepped;
        state.log.step_groups = usize::from(end.stepped);
        state.log.grad_norm = end.grad_norm.filter(|_| end.stepped);
        state.log.loss_scale = self.mixed.as_ref().and_then(Mixed::logged_scale);
        if end.stepped {
            self.log_rounding(state);
            self.refresh_forward(state);
        }
        Ok(())
    }
}

/// MMCV's `detect_anomalous_params` warning: the trainable parameters (module paths) that got
/// no gradient in the group ending at this iteration, where there are any.
fn warn_no_gradient<M: TrainModel>(state: &mut TrainState<M>, missing: Vec<String>) {
    if !missing.is_empty() {
        state.warn(format!(
            "iteration {}: these trainable parameters got no gradient (not used in the loss): {}",
            state.iter,
            missing.join(", ")
        ));
    }
}

impl<M: TrainModel> Hook<M> for OptimizerHook {
    fn name(&self) -> &'static str {
        let asked = self.mixed.as_ref().filter(|mixed| !mixed.implied);
        match (asked, self.groups.cumulative_iters() > 1) {
            (None, false) => "optimizer",
            (None, true) => "cumulative",
            (Some(_), false) => "fp16",
            (Some(_), true) => "cumulative_fp16",
        }
    }

    fn before_run(&mut self, state: &mut TrainState<M>) -> Result<()> {
        self.offload_before_run(state);
        if self.weights16.is_some() {
            crate::weights16::count_step_rounding(true);
        }
        self.check_step_in_backward(state)?;
        self.prepare(state)?;
        self.compress_frozen(state)?;
        // A scaler saved by a resumed run whose 16-bit weights implied it.
        if let Some(saved) = self.saved_state.take().filter(|_| self.mixed.is_some()) {
            if let Err(error) = Hook::<M>::load_state_dict(self, saved) {
                state.warn(format!(
                    "the resumed snapshot's loss scaler does not load ({error}): it starts afresh"
                ));
            }
        }
        let cumulative_iters = self.groups.cumulative_iters();
        if cumulative_iters > 1 {
            if !state.iter.is_multiple_of(cumulative_iters) {
                state.warn(format!(
                    "resuming at iteration {}, which is not a multiple of cumulative_iters ({}): \
                     the gradients of the first {} iterations of this group are lost, which may \
                     change the result slightly",
                    state.iter,
                    cumulative_iters,
                    state.iter % cumulative_iters
                ));
            }
            if has_batch_norm(&state.model) {
                state.warn(format!(
                    "the model has BatchNorm layers: with cumulative_iters = {cumulative_iters}, \
                     their batch statistics see one micro-batch at a time, which may lower the \
                     result slightly"
                ));
            }
        }
        Ok(())
    }

    fn before_iter(&mut self, state: &mut TrainState<M>) -> Result<()> {
        self.plan_passes(state);
        Ok(())
    }

    fn before_forward(&mut self, state: &mut TrainState<M>) -> Result<()> {
        self.offload_start(state);
        self.tap_forward(state);
        Ok(())
    }

    fn after_first_pass(&mut self, state: &mut TrainState<M>) -> Result<()> {
        self.norm_pass(state);
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<M>) -> Result<()> {
        if self.accumulate_pass(state) || self.step_pass(state) {
            return Ok(());
        }
        let Some(sums) = self.backward(state) else {
            return Ok(());
        };
        let boundary = state.every_n_iters(self.groups.cumulative_iters()) || state.is_last_iter();
        if boundary {
            return self.end_group(state, sums);
        }
        self.summed = Some(sums);
        state.log.loss_scale = self.mixed.as_ref().and_then(Mixed::logged_scale);
        Ok(())
    }

    fn after_run(&mut self, state: &mut TrainState<M>) -> Result<()> {
        self.offload_after_run(state);
        Ok(())
    }

    fn after_failure(&mut self, state: &mut TrainState<M>) {
        self.offload_after_run(state);
    }

    fn snapshot_model(&self, _state: &TrainState<M>) -> Option<M> {
        self.offloaded_fp32_model::<M>()
    }

    fn before_save(&self, meta: &mut SnapshotMeta) {
        meta.precision = Some(self.precision());
    }

    /// A snapshot of another precision loads (its weights are the masters'), with a warning
    /// that says what becomes of the loss scaler.
    fn after_load(
        &mut self,
        state: &mut TrainState<M>,
        meta: &SnapshotMeta,
        path: &Path,
    ) -> Result<()> {
        let now = self.precision();
        let Some(saved) = meta.precision.as_ref().filter(|saved| **saved != now) else {
            return Ok(());
        };
        let scaler = if now == "fp32" {
            "its loss scaler is dropped"
        } else if saved == "fp32" {
            "the loss scaler starts afresh at its `init_scale`"
        } else {
            "the loss scaler carries on"
        };
        state.warn(format!(
            "snapshot {} was trained in {saved}, and this run trains in {now}: the weights \
             load, {scaler}; train in the precision of the run that wrote it to resume it \
             exactly",
            path.display()
        ));
        Ok(())
    }

    fn state_dict(&self) -> Option<serde_json::Value> {
        let groups = (self.groups.cumulative_iters() > 1).then(|| {
            serde_json::json!({
                "cumulative_iters": self.groups.cumulative_iters(),
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
            // 16-bit weights imply a scaler once the run starts (`before_run`).
            self.saved_state = Some(value);
            return Ok(());
        };
        let (scaler, prefix) = if self.groups.cumulative_iters() > 1 {
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
