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
//! precision), clip, step or skip, update the scaler.

mod groups;
mod in_backward;
mod reduce;

use std::path::Path;

use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;

use crate::fp16::{wrap_fp16_model, Precision};
use crate::memory;
use crate::parallel::ZeroStage;
use crate::scaler::LossScaler;
use crate::train::grads::{self, GradClip};
use crate::train::{Hook, SnapshotMeta, TrainModel, TrainState};
use crate::{Error, Result};
use in_backward::{InBackward, Phase};

pub use groups::Groups;
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
    /// The step in backward's state: `InBackward<B>` for the backend trained on.
    in_backward: Option<Box<dyn std::any::Any + Send>>,
}

/// The precision part under mixed precision: the scaler, and the half type of the forward copy.
#[derive(Clone, Debug)]
struct Mixed {
    scaler: LossScaler,
    precision: Precision,
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
            in_backward: None,
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
        self.mixed = Some(Mixed { scaler, precision });
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
            in_backward: self.in_backward,
        }
    }

    /// The same hook stepping each parameter during backward, as soon as its gradient is
    /// final, and freeing the gradient at once (PyTorch's optimizer hooks in backward, LOMO):
    /// the whole set of gradients never exists. The weights and optimizer state are exactly
    /// those of the ordinary step. Global-norm clipping and mixed precision need every
    /// gradient before any step: the forward and backward then run twice, the first backward
    /// keeping only the norm and the overflow flag (one more forward and backward per step).
    /// Under accumulation, the group's last micro-batch steps in its backward. Needs Burn's
    /// autodiff backend; not with data parallelism.
    pub fn with_step_in_backward(mut self, on: bool) -> Self {
        self.step_in_backward = on;
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

    /// The step in backward's state for the backend `B`.
    fn part<B: AutodiffBackend>(&mut self) -> &mut InBackward<B> {
        if !self
            .in_backward
            .as_ref()
            .is_some_and(|part| part.is::<InBackward<B>>())
        {
            self.in_backward = Some(Box::new(InBackward::<B>::default()));
        }
        self.in_backward
            .as_mut()
            .and_then(|part| part.downcast_mut::<InBackward<B>>())
            .expect("made above for this backend")
    }

    /// Warns of the trainable parameters that got no gradient in backward (those not in
    /// `reached`), where `detect_anomalous_params` asks.
    fn warn_missing<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &mut TrainState<B, M>,
        reached: &std::collections::HashSet<burn::module::ParamId>,
    ) {
        if self.detect_anomalous_params {
            let missing = in_backward::missing::<B, M>(&state.model, reached);
            warn_without_gradient(state, missing);
        }
    }

    /// `after_iter` of an iteration whose forward ran on tapped parameters: a first pass
    /// (the norm and the overflow flag) or a step pass (see [`in_backward`]).
    fn after_iter_in_backward<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) -> Result<()>
    where
        R: Reducer<B>,
    {
        let Some(loss) = state.loss.take() else {
            return Ok(());
        };
        if state.pass == 0 {
            state.log.loss = Some(grads::scalar(&loss));
            self.reducer.mean_for_log(&mut state.log)?;
        }
        let loss = self.loss_to_backward(state, loss);
        let mixed = self.mixed.is_some();
        let norm_type = self.grad_clip.as_ref().map_or(2.0, |clip| clip.norm_type);
        if self.part::<B>().phase() == Some(Phase::Norm) {
            let summed = self.summed.take();
            let (norm, reached) = memory::in_phase(memory::phase::BACKWARD, || {
                self.part::<B>()
                    .norm_pass(state, loss, summed.as_ref(), mixed)
            })?;
            self.summed = summed;
            self.warn_missing(state, &reached);
            let norm = match &self.mixed {
                Some(mixed) => norm.map(|norm| norm / mixed.scaler.loss_scale()),
                None => norm,
            };
            let overflow = mixed
                && self
                    .reducer
                    .any(norm.is_some_and(|norm| !norm.is_finite()))?;
            self.part::<B>().untap(state);
            if overflow {
                // Skipped as by the ordinary step: no second pass.
                state.forward_passes = 1;
                self.summed = None;
                self.pending = 0;
                if let Some(mixed) = &mut self.mixed {
                    let scale = mixed.scaler.loss_scale();
                    if let Some(advice) = mixed.scaler.first_overflow_advice(true) {
                        state.warn(advice);
                    }
                    mixed.scaler.update_scale(true);
                    state.warn(format!(
                        "iteration {}: gradient overflow (inf or NaN) at loss scale {scale}; the \
                         step is skipped and the loss scale lowered to {}",
                        state.iter,
                        mixed.scaler.loss_scale()
                    ));
                    state.log.loss_scale = Some(mixed.scaler.loss_scale());
                }
                state.log.overflow = true;
                return Ok(());
            }
            let peers = self.reducer.tap_peers(&state.model);
            let part = self.part::<B>();
            part.set_norm(norm);
            part.tap(state, Phase::Step, norm_type, false, peers);
            return Ok(());
        }
        // The step pass (the only one, or the second).
        let two = mixed || self.grad_clip.is_some();
        let (unscale, coefficient) = if two {
            let norm = self.part::<B>().norm();
            let unscale = self
                .mixed
                .as_ref()
                .map(|mixed| 1.0 / mixed.scaler.loss_scale());
            let coefficient = match (&self.grad_clip, norm) {
                (Some(clip), Some(norm)) if mixed || norm.is_finite() => {
                    Some(clip.max_norm / (norm + 1e-6))
                }
                _ => None,
            }
            .filter(|&coefficient| coefficient < 1.0);
            (unscale, coefficient)
        } else {
            (None, None)
        };
        let summed = self.summed.take();
        self.pending = 0;
        let (norm, reached) = memory::in_phase(memory::phase::BACKWARD, || {
            self.part::<B>()
                .step_pass(state, loss, summed, unscale, coefficient)
        })?;
        if self.reducer.zero_stage() > ZeroStage::Off {
            // Each peer stepped its part: every peer takes the others' new values, and the
            // forward copy is made again from them.
            self.reducer.share_stepped(&mut state.model)?;
            if let Some(mixed) = &self.mixed {
                state.forward_model = None;
                state.forward_model = Some(memory::scope(memory::phase::HALF_WEIGHTS, || {
                    wrap_fp16_model(state.model.clone(), mixed.precision)
                }));
            }
        }
        if two {
            state.log.grad_norm = self.part::<B>().norm();
        } else {
            self.warn_missing(state, &reached);
            state.log.grad_norm = norm;
        }
        state.log.stepped = true;
        state.log.step_groups = reached.len();
        if let Some(mixed) = &mut self.mixed {
            mixed.scaler.update_scale(false);
            state.log.loss_scale = Some(mixed.scaler.loss_scale());
        }
        Ok(())
    }

    /// The loss backward starts from: divided by MMCV's loss factor, and scaled (in fp32) under
    /// mixed precision.
    fn loss_to_backward<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &TrainState<B, M>,
        loss: burn::tensor::Tensor<B, 1>,
    ) -> burn::tensor::Tensor<B, 1> {
        let divisor = self.groups.loss_factor(state.iter, state.max_iters) as f64;
        match &self.mixed {
            None => loss.div_scalar(divisor),
            Some(mixed) => loss
                .cast(DType::F32)
                .mul_scalar(mixed.scaler.loss_scale() / divisor),
        }
    }

    /// Whether the group's last backward averages the gradients over the peers as it makes
    /// them, each kept by its owner only (ZeRO stage 2, without the step in backward).
    fn reduces_in_backward<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &TrainState<B, M>,
    ) -> bool
    where
        R: Reducer<B>,
    {
        !self.step_in_backward
            && self.reducer.zero_stage() >= ZeroStage::Gradients
            && state.world_size() > 1
            && in_backward::supported::<B>()
    }

    /// `after_iter` of a group's last iteration whose gradients are averaged in backward (see
    /// [`Self::reduces_in_backward`]): the backward pass, then the ordinary step of the
    /// gradients this peer kept.
    fn after_iter_reduced<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) -> Result<()>
    where
        R: Reducer<B>,
    {
        let Some(loss) = state.loss.take() else {
            self.part::<B>().untap(state);
            return Ok(());
        };
        state.log.loss = Some(grads::scalar(&loss));
        self.reducer.mean_for_log(&mut state.log)?;
        let loss = self.loss_to_backward(state, loss);
        let mixed = self.mixed.is_some();
        let summed = self.summed.take();
        self.pending = 0;
        let reduced = memory::in_phase(memory::phase::BACKWARD, || {
            self.part::<B>().reduce_pass(state, loss, summed, mixed)
        });
        self.part::<B>().untap(state);
        let (grads, reached) = reduced?;
        self.warn_missing(state, &reached);
        memory::scope(memory::phase::STEP, || self.step(state, grads, true))
    }

    /// The end of a group: unscale (half precision), check for overflow, clip, step or skip.
    /// `reduced`: the gradients were averaged over the peers in backward, and only this peer's
    /// part kept.
    fn step<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
        mut grads: GradientsParams,
        reduced: bool,
    ) -> Result<()>
    where
        R: Reducer<B>,
    {
        if !reduced {
            // The mean over the peers, once per group, before anything reads the gradients
            // (the norm, the overflow check, clipping); every peer gets the same bits.
            self.reducer.mean_grads(&state.model, &mut grads)?;
            if self.detect_anomalous_params {
                let missing = grads::params_without_grad::<B, M>(&state.model, &grads);
                warn_without_gradient(state, missing);
            }
        }
        // ZeRO: the gradients another peer steps go, at once at stage 2 (the norm is then
        // gathered from the owners), after the norm at stage 1.
        let sharded = self.reducer.zero_stage();
        if sharded >= ZeroStage::Gradients {
            self.reducer.keep_own(&state.model, &mut grads);
        }
        let norm_type = self.grad_clip.as_ref().map_or(2.0, |clip| clip.norm_type);
        let Some(mixed) = &mut self.mixed else {
            let norm = self.reducer.global_norm(&state.model, &grads, norm_type)?;
            self.reducer.keep_own(&state.model, &mut grads);
            if let (Some(clip), Some(norm)) = (&self.grad_clip, norm) {
                let coefficient = clip.max_norm / (norm + 1e-6);
                if norm.is_finite() && coefficient < 1.0 {
                    grads::scale::<B, M>(&state.model, &mut grads, coefficient);
                }
            }
            state.log.grad_norm = norm;
            state.step(grads);
            if sharded > ZeroStage::Off {
                self.reducer.share_stepped(&mut state.model)?;
            }
            return Ok(());
        };
        // The gradients are still half (one micro-batch) or fp32 sums (accumulation), and
        // scaled. Their norm is taken as they are and unscaled after (the same value, for a
        // power-of-two scale); each chunk of parameters is then cast, unscaled and clipped just
        // before it steps, in the order a full fp32 copy would have been.
        let scale = mixed.scaler.loss_scale();
        let norm = self
            .reducer
            .global_norm(&state.model, &grads, norm_type)?
            .map(|n| n / scale);
        // One non-finite gradient on any peer skips the step on every peer.
        let overflow = self
            .reducer
            .any(norm.is_some_and(|norm| !norm.is_finite()))?;
        if overflow {
            if let Some(advice) = mixed.scaler.first_overflow_advice(true) {
                state.warn(advice);
            }
            mixed.scaler.update_scale(true);
            state.log.overflow = true;
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
            self.reducer.keep_own(&state.model, &mut grads);
            // Each chunk of parameters the optimizer steps at once.
            state.step_with(grads, &mut |model, chunk| {
                grads::to_f32::<B, M>(model, chunk);
                grads::scale::<B, M>(model, chunk, 1.0 / scale);
                if let Some(coefficient) = clip {
                    grads::scale::<B, M>(model, chunk, coefficient);
                }
            });
            if sharded > ZeroStage::Off {
                self.reducer.share_stepped(&mut state.model)?;
            }
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

/// MMCV's `detect_anomalous_params` warning, naming the parameters `missing` (if any).
fn warn_without_gradient<B: AutodiffBackend, M: TrainModel<B>>(
    state: &mut TrainState<B, M>,
    missing: Vec<String>,
) {
    if !missing.is_empty() {
        state.warn(format!(
            "iteration {}: these trainable parameters got no gradient (not used in the loss): {}",
            state.iter,
            missing.join(", ")
        ));
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>> Hook<B, M> for OptimizerHook<R> {
    fn name(&self) -> &'static str {
        match (&self.mixed, self.groups.cumulative_iters() > 1) {
            (None, false) => "optimizer",
            (None, true) => "cumulative",
            (Some(_), false) => "fp16",
            (Some(_), true) => "cumulative_fp16",
        }
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if self.step_in_backward {
            if !in_backward::supported::<B>() {
                return Err(Error::invalid(
                    "step_in_backward",
                    format!(
                        "needs Burn's autodiff backend (`Autodiff<..>`), whose graph the step \
                         joins; this run's backend is `{}`",
                        std::any::type_name::<B>()
                    ),
                ));
            }
            if state.world_size() > 1 && self.reducer.tap_peers(&state.model).is_none() {
                return Err(Error::invalid(
                    "step_in_backward",
                    format!(
                        "is on in a data-parallel run of {} peers whose optimizer hook cannot \
                         average the gradients over them as backward makes them: give it the \
                         peers' reducer (`OptimizerHook::with_reducer(PeerReducer::new(..))`)",
                        state.world_size()
                    ),
                ));
            }
        }
        self.groups.warn(state);
        // ZeRO: this peer keeps the state of its part only (a resumed state is whole).
        self.reducer.own_state(&state.model, &mut state.optimizer);
        state.sharded_optimizer = self.reducer.zero_stage() > ZeroStage::Off;
        if let Some(mixed) = &self.mixed {
            if let Some(half) = crate::train::params::first_half_param::<B, M>(&state.model) {
                return Err(Error::invalid(
                    "model",
                    format!(
                        "the runner was given a model already in half precision (`{half}` is \
                         half): under mixed precision the optimizer hook keeps the weights in \
                         fp32 as the masters and makes the half copy for the forward itself. \
                         Pass the fp32 model, without `wrap_fp16_model`"
                    ),
                ));
            }
            state.forward_model = Some(memory::scope(memory::phase::HALF_WEIGHTS, || {
                wrap_fp16_model(state.model.clone(), mixed.precision)
            }));
        }
        Ok(())
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if !self.groups.boundary(state) {
            return Ok(());
        }
        if self.reduces_in_backward(state) {
            let peers = self.reducer.tap_peers(&state.model);
            self.part::<B>()
                .tap(state, Phase::Reduce, 2.0, false, peers);
            return Ok(());
        }
        if !self.step_in_backward {
            return Ok(());
        }
        // Clipping and the overflow check need every gradient's norm first: two passes.
        let two = self.mixed.is_some() || self.grad_clip.is_some();
        if two {
            state.forward_passes = 2;
        }
        let norm_type = self.grad_clip.as_ref().map_or(2.0, |clip| clip.norm_type);
        let phase = if two { Phase::Norm } else { Phase::Step };
        let peers = self.reducer.tap_peers(&state.model);
        self.part::<B>().tap(state, phase, norm_type, !two, peers);
        Ok(())
    }

    fn after_first_pass(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if self.step_in_backward && self.part::<B>().active() {
            return self.after_iter_in_backward(state);
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if self.part::<B>().active() {
            if self.part::<B>().phase() == Some(Phase::Reduce) {
                return self.after_iter_reduced(state);
            }
            return self.after_iter_in_backward(state);
        }
        let Some(loss) = state.loss.take() else {
            return Ok(());
        };
        state.log.loss = Some(grads::scalar(&loss));
        // The log shows the mean over the peers (MMDetection's `_parse_losses`).
        self.reducer.mean_for_log(&mut state.log)?;
        let divisor = self.groups.loss_factor(state.iter, state.max_iters) as f64;
        let summed = self.summed.take();
        let grads = memory::in_phase(memory::phase::BACKWARD, || match &self.mixed {
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
        self.pending += 1;
        if self.groups.boundary(state) {
            self.pending = 0;
            memory::scope(memory::phase::STEP, || self.step(state, grads, false))?;
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

    fn held_shares(&self, state: &TrainState<B, M>) -> (f64, f64) {
        let share = 1.0 / state.world_size().max(1) as f64;
        match self.reducer.zero_stage() {
            ZeroStage::Off => (1.0, 1.0),
            ZeroStage::OptimizerState => (1.0, share),
            ZeroStage::Gradients => (share, share),
        }
    }

    fn before_snapshot(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if let Some(whole) = self.reducer.whole_state(&state.model, &state.optimizer)? {
            if state.is_main() {
                state.whole_optimizer = Some(whole);
            }
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
        let now = self.precision();
        if let Some(saved) = meta.precision.as_ref().filter(|saved| **saved != now) {
            let scaler = if now == "fp32" {
                "its loss scaler is dropped"
            } else if saved == "fp32" {
                "the loss scaler starts afresh at its `init_scale`"
            } else {
                "the loss scaler carries on"
            };
            state.warn(format!(
                "checkpoint {} was trained in {saved}, and this config trains in {now}: the \
                 weights load (they are kept in fp32), {scaler}; set `[fp16]` as the run that \
                 wrote it did to resume it exactly",
                path.display()
            ));
        }
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

/// MMCV's `Fp16OptimizerHook`: mixed precision with fp32 master weights and loss scaling, a
/// step every iteration. Before the run the forward model becomes a half copy of the weights
/// (`wrap_fp16_model`); each iteration back-propagates `loss * scale` through it, casts the half
/// gradients onto the fp32 weights and divides them by the scale; on any inf or NaN the step is
/// skipped (weights and optimizer state untouched) and the scale backs off, else the gradients
/// are clipped, the fp32 weights step and the half copy is refreshed.
pub struct Fp16OptimizerHook;

impl Fp16OptimizerHook {
    /// The hook, in f16 (`OptimizerHook::with_mixed_precision` for bf16).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(loss_scaler: LossScaler) -> OptimizerHook {
        OptimizerHook::new().with_mixed_precision(loss_scaler, Precision::F16)
    }

    /// MMCV's default: a static scale of 512.
    #[allow(clippy::should_implement_trait)]
    pub fn default() -> OptimizerHook {
        Self::new(
            LossScaler::fixed(crate::scaler::MMCV_STATIC_SCALE).expect("512 is a valid scale"),
        )
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
