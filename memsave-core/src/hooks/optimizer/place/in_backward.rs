//! The step in backward (`step_in_backward = true`): each parameter steps as soon as backward
//! has made its final gradient, and the gradient is freed at once, so the whole set of
//! gradients never exists (PyTorch's optimizer hooks in backward, torchtune's
//! `optimizer_in_bwd`, LOMO). The taps are [`crate::train::tapping`]'s.
//!
//! Global-norm clipping and the overflow check of mixed precision need every gradient before
//! any step: the group's last iteration then runs its forward and backward twice (LOMO's
//! answer), the first backward keeping only the norm, the second stepping. An overflow skips
//! the second pass. Under accumulation, the group's last micro-batch steps in its backward; the
//! earlier ones add up as without (on the host under optimizer offload: [`super::OnHost`]). With peers, each gradient is averaged over them as its tap
//! hands it over, each parameter stepped by its owner under ZeRO and the new values shared.

use burn::tensor::backend::AutodiffBackend;

use super::super::parts::Parts;
use super::super::Reducer;
use super::StepPlace;
use crate::memory;
use crate::train::grads;
use crate::train::optim::{HostState, HostSums};
use crate::train::tapping::{self, Phase};
use crate::train::{TrainModel, TrainState};
use crate::{Error, Result};

/// The step in backward: one pass, or two (a norm pass, then a step pass).
#[derive(Clone, Copy, Debug, Default)]
pub(in super::super) struct InBackward {
    /// Whether the group's last iteration takes two passes (clipping or mixed precision).
    two: bool,
    /// The norm the first pass found (unscaled), for the second.
    norm: Option<f64>,
}

impl StepPlace for InBackward {
    fn before_run<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        if !tapping::supported::<B>() {
            return Err(Error::invalid(
                "step_in_backward",
                format!(
                    "needs Burn's autodiff backend (`Autodiff<..>`), whose graph the step joins; \
                     this run's backend is `{}`",
                    std::any::type_name::<B>()
                ),
            ));
        }
        if state.world_size() > 1 && parts.reducer.tap_peers(&state.model).is_none() {
            return Err(Error::invalid(
                "step_in_backward",
                format!(
                    "is on in a data-parallel run of {} peers whose optimizer hook cannot \
                     average the gradients over them as backward makes them: give it the peers' \
                     reducer (`OptimizerHook::with_reducer(PeerReducer::new(..))`)",
                    state.world_size()
                ),
            ));
        }
        Ok(())
    }

    fn before_last_iter<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        // Clipping and the overflow check need every gradient's norm first: two passes.
        self.two = parts.is_mixed() || parts.grad_clip.is_some();
        if self.two {
            state.forward_passes = 2;
        }
        let phase = if self.two { Phase::Norm } else { Phase::Step };
        super::tap(parts, state, phase, parts.norm_type(), !self.two);
        Ok(())
    }

    /// Under mixed precision, training alone, a micro-batch that does not end its group is
    /// tapped: each half gradient is added to its fp32 sum as soon as it is final, and no whole
    /// set of half gradients is made beside the sums. (In fp32 the sums seed the backward,
    /// which makes no second set either.)
    fn before_micro_batch<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        if parts.is_mixed() && state.world_size() == 1 {
            super::tap(parts, state, Phase::Accumulate, parts.norm_type(), false);
        }
        Ok(())
    }

    fn accumulate<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        self.accumulate_pass(parts, state, None)
    }

    fn after_first_pass<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        self.norm_pass(parts, state, None)
    }

    /// The step pass (the only one, or the second).
    fn end_group<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        self.step_pass(parts, state, None)
    }
}

impl InBackward {
    /// A micro-batch that does not end its group: where it was tapped, backward with each
    /// gradient added to its sum as soon as it is final, on the host in `host_sums` (optimizer
    /// offload, [`super::OnHost`]) or on the device; else the ordinary backward into the sums.
    pub(super) fn accumulate_pass<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
        host_sums: Option<&mut HostSums>,
    ) -> Result<()> {
        if state.tapping.phase() != Some(Phase::Accumulate) {
            return parts.accumulate(state);
        }
        let mut tapping = std::mem::take(&mut state.tapping);
        let logged = match state.loss.take() {
            Some(loss) => {
                let logged = parts.log_loss(state, &loss);
                let loss = parts.loss_to_backward(state, loss);
                let on_device = host_sums.is_none();
                let summed = &mut *parts.summed;
                let passed = memory::in_phase(memory::phase::BACKWARD, || {
                    tapping.accumulate_pass(loss, host_sums, summed)
                });
                if let (true, Some(sums)) = (on_device, summed.as_mut()) {
                    // A group's first sums, in fp32 (those in fp32 already are left as they are).
                    memory::scope(memory::phase::BACKWARD, || {
                        grads::to_f32::<B, M>(&state.model, sums)
                    });
                }
                *parts.pending += 1;
                logged.and(passed)
            }
            None => Ok(()),
        };
        tapping.untap(state);
        state.tapping = tapping;
        if let Some(mixed) = &parts.mixed {
            state.log.loss_scale = mixed.logged_scale();
        }
        logged
    }

    /// The norm pass (the first of two), the group's sums on the host in `host_sums` where the
    /// step is there ([`super::OnHost`]); an overflow drops them.
    pub(super) fn norm_pass<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
        mut host_sums: Option<&mut HostSums>,
    ) -> Result<()> {
        if state.tapping.phase() != Some(Phase::Norm) {
            return Ok(());
        }
        let Some(loss) = state.loss.take() else {
            return Ok(());
        };
        parts.log_loss(state, &loss)?;
        let loss = parts.loss_to_backward(state, loss);
        let mixed = parts.is_mixed();
        let mut tapping = std::mem::take(&mut state.tapping);
        let summed = parts.summed.take();
        let outcome = memory::in_phase(memory::phase::BACKWARD, || {
            tapping.norm_pass(
                state,
                loss,
                summed.as_ref(),
                mixed,
                host_sums.as_deref_mut(),
            )
        });
        *parts.summed = summed;
        let (norm, reached) = match outcome {
            Ok(found) => found,
            Err(error) => {
                state.tapping = tapping;
                return Err(error);
            }
        };
        parts.warn_missing(state, &reached);
        let norm = match &parts.mixed {
            Some(mixed) => norm.map(|norm| norm / mixed.scaler.loss_scale()),
            None => norm,
        };
        let overflow = match mixed {
            true => parts
                .reducer
                .any(norm.is_some_and(|norm| !norm.is_finite())),
            false => Ok(false),
        };
        tapping.untap(state);
        state.tapping = tapping;
        if overflow? {
            // Skipped as by the ordinary step: no second pass.
            state.forward_passes = 1;
            *parts.summed = None;
            if let Some(sums) = host_sums {
                *sums = HostSums::default();
            }
            *parts.pending = 0;
            if let Some(mixed) = parts.mixed.as_deref_mut() {
                mixed.skip_overflow(state);
            }
            return Ok(());
        }
        self.norm = norm;
        super::tap(parts, state, Phase::Step, parts.norm_type(), false);
        Ok(())
    }

    /// The step pass (the only one, or the second), each parameter stepped on the device with
    /// the optimizer's state, or on the host with `host`'s ([`super::OnHost`]).
    pub(super) fn step_pass<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
        host: Option<&mut HostState>,
    ) -> Result<()> {
        let Some(loss) = state.loss.take() else {
            return Ok(());
        };
        if state.pass == 0 {
            parts.log_loss(state, &loss)?;
        }
        let loss = parts.loss_to_backward(state, loss);
        let mixed = parts.is_mixed();
        let (unscale, coefficient) = if self.two {
            let unscale = parts
                .mixed
                .as_ref()
                .map(|mixed| 1.0 / mixed.scaler.loss_scale());
            let coefficient = match (parts.grad_clip, self.norm) {
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
        let summed = parts.summed.take();
        *parts.pending = 0;
        let mut tapping = std::mem::take(&mut state.tapping);
        let outcome = memory::in_phase(memory::phase::BACKWARD, || {
            tapping.step_pass(state, loss, summed, unscale, coefficient, mixed, host)
        });
        state.tapping = tapping;
        let (norm, reached) = outcome?;
        // Under ZeRO each peer stepped its part: every peer takes the others' new values, and
        // the forward copy is made again from them (alone, the taps recast it as they step).
        if parts.reducer.shards() {
            parts.reducer.share_stepped(&mut state.model)?;
            if let Some(mixed) = &parts.mixed {
                mixed.refresh_forward(state);
            }
        }
        if self.two {
            state.log.grad_norm = self.norm;
        } else {
            parts.warn_missing(state, &reached);
            state.log.grad_norm = norm;
        }
        state.log.stepped = true;
        state.log.step_groups = reached.len();
        if let Some(mixed) = parts.mixed.as_deref_mut() {
            mixed.stepped(state);
        }
        Ok(())
    }
}
