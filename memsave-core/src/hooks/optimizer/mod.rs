//! The optimizer hook: backward and step, composed of a *precision* part (fp32, or half
//! precision with a loss scaler and fp32 master weights), a *grouping* part (step every
//! `cumulative_iters` iterations; 1: every one) and a *reduction* part (training alone, or
//! averaging over data-parallel peers: [`Reducer`]). MMCV's four hooks are the four corners
//! of the first two:
//!
//! | | every iteration | groups of `cumulative_iters` |
//! |---|---|---|
//! | fp32 | [`OptimizerHook::new`] | [`GradientCumulativeOptimizerHook::new`] |
//! | half | [`Fp16OptimizerHook::new`] | [`GradientCumulativeFp16OptimizerHook::new`] |
//!
//! Each iteration: backward of `loss / factor` (times the loss scale in half precision), its
//! gradients added to the group's (in the backward pass itself, see
//! [`crate::train::grads::backward`]); at a group's end: unscale, overflow check (half
//! precision), clip, step or skip, update the scaler. *Where* that step runs is the fourth part
//! ([`place`]): after backward, in backward as each gradient is final, or after a backward that
//! reduces each gradient to its owner (ZeRO stage 2). This file composes the parts.

mod groups;
mod mmcv;
mod parts;
mod place;
mod precision;
mod reduce;
mod step;

use std::path::Path;

use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use crate::fp16::Precision;
use crate::scaler::LossScaler;
use crate::train::grads::GradClip;
use crate::train::{Hook, SnapshotMeta, TrainModel, TrainState};
use crate::{Error, Result};
use parts::Parts;
use place::{Place, StepPlace};
use precision::Mixed;

pub use groups::Groups;
pub use mmcv::{
    Fp16OptimizerHook, GradientCumulativeFp16OptimizerHook, GradientCumulativeOptimizerHook,
};
pub use reduce::{Alone, Reducer};

/// Backward, optional global-norm clipping, step (MMCV's `OptimizerHook`), in fp32 or half
/// precision, every iteration or in groups, alone or averaged over peers with `R` (see the
/// module docs).
#[derive(Debug)]
pub struct OptimizerHook<R = Alone> {
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
    reducer: R,
    /// Step each parameter in backward as soon as its gradient is final, and free the
    /// gradient (see [`OptimizerHook::with_step_in_backward`]).
    pub step_in_backward: bool,
    /// Step on the host, the optimizer's state and fp32 masters in host memory (see
    /// [`OptimizerHook::with_optimizer_offload`]).
    pub optimizer_offload: bool,
    /// Where the step runs in this run (chosen before it).
    place: Place,
    /// A resumed snapshot's state of this hook, kept until the run starts where the 16-bit
    /// weights imply the loss scaler it holds.
    saved_state: Option<serde_json::Value>,
    /// Whether the run's first forward was checked ([`OptimizerHook::check_first_forward`]).
    forward_checked: bool,
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
            groups: Groups::EVERY_ITERATION,
            summed: None,
            pending: 0,
            reducer: Alone,
            step_in_backward: false,
            optimizer_offload: false,
            place: Place::default(),
            saved_state: None,
            forward_checked: false,
        }
    }
}

impl<R> OptimizerHook<R> {
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
        self.mixed = Some(Mixed::new(scaler, precision));
        self
    }

    /// The same hook stepping every `cumulative_iters` iterations.
    pub fn with_groups(mut self, groups: Groups) -> Self {
        self.groups = groups;
        self
    }

    /// The same hook averaging over peers with `reducer` (a data-parallel run:
    /// [`crate::parallel::PeerReducer`]).
    pub fn with_reducer<R2>(self, reducer: R2) -> OptimizerHook<R2> {
        OptimizerHook {
            grad_clip: self.grad_clip,
            detect_anomalous_params: self.detect_anomalous_params,
            mixed: self.mixed,
            groups: self.groups,
            summed: self.summed,
            pending: self.pending,
            reducer,
            step_in_backward: self.step_in_backward,
            optimizer_offload: self.optimizer_offload,
            place: self.place,
            saved_state: self.saved_state,
            forward_checked: self.forward_checked,
        }
    }

    /// The same hook stepping each parameter during backward, as soon as its gradient is
    /// final, and freeing the gradient at once (PyTorch's optimizer hooks in backward, LOMO):
    /// the whole set of gradients never exists. The weights and optimizer state are exactly
    /// those of the ordinary step. Global-norm clipping and mixed precision need every
    /// gradient before any step: the forward and backward then run twice, the first backward
    /// keeping only the norm and the overflow flag (one more forward and backward per step).
    /// Under accumulation, the group's last micro-batch steps in its backward. Needs Burn's
    /// autodiff backend; with data parallelism, each gradient is averaged over the peers as
    /// backward makes it.
    pub fn with_step_in_backward(mut self, on: bool) -> Self {
        self.step_in_backward = on;
        self
    }

    /// The same hook with the optimizer's state and the fp32 master weights in host memory
    /// (optimizer offload, DeepSpeed's ZeRO-Offload): in backward, each gradient is copied to
    /// the host as soon as it is final and freed on the device, its parameter stepped on the
    /// host by the optimizer's own rule, and the new value copied up (the step in backward's
    /// taps, one pass or two as [`OptimizerHook::with_step_in_backward`] says). On a device
    /// whose tensors are host memory (Flex) there is nothing to offload to: it says so once and
    /// steps as without.
    pub fn with_optimizer_offload(mut self, on: bool) -> Self {
        self.optimizer_offload = on;
        self
    }

    /// The precision the forward runs in (`"fp32"`, `"f16"`, `"bf16"`): written in
    /// snapshots, compared on resume.
    pub fn precision(&self) -> String {
        match &self.mixed {
            None => "fp32".to_string(),
            Some(mixed) => mixed.precision.to_string(),
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

    /// The divisor of iteration `iter`'s loss in a run of `max_iters` iterations.
    pub fn loss_factor(&self, iter: usize, max_iters: usize) -> usize {
        self.groups.loss_factor(iter, max_iters)
    }

    /// After the run's first forward: every frozen weight held compressed was read by a
    /// layer that dequantizes it.
    fn check_first_forward<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &TrainState<B, M>,
    ) -> Result<()> {
        if std::mem::replace(&mut self.forward_checked, true) {
            return Ok(());
        }
        precision::check_frozen_reads(state)
    }

    /// The place of the step, and the other parts as it sees them.
    fn split(&mut self) -> (&mut Place, Parts<'_, R>) {
        (
            &mut self.place,
            Parts {
                grad_clip: self.grad_clip.as_ref(),
                detect_anomalous_params: self.detect_anomalous_params,
                mixed: self.mixed.as_mut(),
                groups: self.groups,
                summed: &mut self.summed,
                pending: &mut self.pending,
                reducer: &self.reducer,
            },
        )
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>> Hook<B, M> for OptimizerHook<R> {
    fn name(&self) -> &'static str {
        let asked = self.mixed.as_ref().filter(|mixed| !mixed.implied);
        match (asked, self.groups.cumulative_iters() > 1) {
            (None, false) => "optimizer",
            (None, true) => "cumulative",
            (Some(_), false) => "fp16",
            (Some(_), true) => "cumulative_fp16",
        }
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.place = Place::choose(
            self.step_in_backward,
            self.optimizer_offload,
            &self.reducer,
            state,
        );
        // The half copy first: the step on the host may keep it alone on the device.
        precision::before_run(&mut self.mixed, state)?;
        // A scaler saved by a resumed run whose 16-bit weights implied it.
        if let Some(saved) = self.saved_state.take().filter(|_| self.mixed.is_some()) {
            if let Err(error) = Hook::<B, M>::load_state_dict(self, saved) {
                state.warn(format!(
                    "the resumed snapshot's loss scaler does not load ({error}): it starts afresh"
                ));
            }
        }
        let (place, parts) = self.split();
        place.before_run(&parts, state)?;
        groups::warn(self.groups, state);
        // ZeRO: this peer keeps the state of its part only (a resumed state is whole).
        self.reducer.own_state(&state.model, &mut state.optimizer);
        state.sharded_optimizer = self.reducer.shards();
        Ok(())
    }

    fn after_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.place.after_run(state)
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let boundary = groups::boundary(self.groups, state);
        let (place, parts) = self.split();
        if boundary {
            place.before_last_iter(&parts, state)
        } else {
            place.before_micro_batch(&parts, state)
        }
    }

    fn after_first_pass(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.check_first_forward(state)?;
        let (place, mut parts) = self.split();
        place.after_first_pass(&mut parts, state)
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.check_first_forward(state)?;
        let boundary = groups::boundary(self.groups, state);
        let (place, mut parts) = self.split();
        if boundary {
            place.end_group(&mut parts, state)
        } else {
            place.accumulate(&mut parts, state)
        }
    }

    fn held_shares(&self, state: &TrainState<B, M>) -> (f64, f64) {
        self.reducer.held_shares(state.world_size())
    }

    fn before_snapshot(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        // The state is the optimizer's, or the place's where it holds it (on the host).
        let held = self.place.held_state().transpose()?;
        let whole = self
            .reducer
            .whole_state(&state.model, &state.optimizer, held.as_deref())?
            .or(held);
        if let Some(whole) = whole {
            if state.is_main() {
                state.whole_optimizer = Some(whole);
            }
        }
        // The 16-bit weights' compensations, each peer's for its own parameters under ZeRO.
        if let Some(store) = &state.weights {
            if let Some(parts) = self.reducer.gather_parts(&store.to_bytes())? {
                let whole = crate::train::WeightStore::<B::InnerBackend>::merge_bytes(&parts)
                    .map_err(|error| Error::state("the weights' store", error))?;
                if state.is_main() {
                    state.whole_weights = Some(whole);
                }
            }
        }
        // The weights too, where the place holds them (serialising is not training).
        if state.is_main() {
            state.whole_model =
                crate::memory::without_peak(|| self.place.held_model(state)).transpose()?;
        }
        Ok(())
    }

    fn before_save(&self, meta: &mut SnapshotMeta) {
        meta.precision = Some(self.precision());
    }

    /// A snapshot of another precision loads (its weights are fp32), with a warning that says
    /// what becomes of the loss scaler.
    fn after_load(
        &mut self,
        state: &mut TrainState<B, M>,
        meta: &SnapshotMeta,
        path: &Path,
    ) -> Result<()> {
        // A change of the weights' type is the runner's notice (the weights are not fp32).
        let weights = state.weights.as_ref().map(|store| store.spec().dtype);
        if weights != meta.weights.map(|spec| spec.dtype) {
            return Ok(());
        }
        let now = match (&self.mixed, weights) {
            (None, Some(dtype)) => dtype.to_string(),
            _ => self.precision(),
        };
        precision::after_load(&now, meta.precision.as_ref(), state, path);
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
            // 16-bit weights may imply a scaler once the run starts (`before_run`).
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
