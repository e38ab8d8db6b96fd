//! The optimizer hook's step in backward (`OptimizerHook::with_step_in_backward`): which
//! iterations step in backward, in how many passes, and what each pass logs. The passes
//! themselves are [`super::in_backward`]'s.

use burn::tensor::DType;

use super::in_backward::{InBackward, PassSettings, Phase};
use super::{Mixed, OptimizerHook};
use crate::memory::{in_phase, phase, scope};
use crate::train::params::params_not_reached;
use crate::train::step::{skip_on_overflow, GroupEnd};
use crate::train::{TrainModel, TrainState};

/// The step in backward's state in the hook.
#[derive(Debug, Default)]
pub(super) struct StepInBackward {
    passes: InBackward,
    /// The norm the first of two passes found (unscaled), for the second.
    first_norm: Option<f64>,
    /// The first pass overflowed: the iteration's step is skipped.
    skipped: bool,
}

impl OptimizerHook {
    /// The same hook stepping each parameter during backward, as soon as its gradient is final,
    /// and freeing the gradient at once: the whole set of gradients never exists (PyTorch's
    /// optimizer hooks in backward, torchtune's `optimizer_in_bwd`). The weights it trains are
    /// the ordinary step's, bit for bit, for any per-parameter rule (Burn's optimizers,
    /// `Adam8`, `Weights16` with Kahan or nearest rounding; stochastic rounding draws per
    /// parameter in the order parameters first step, which backward reverses). Clipping, mixed
    /// precision and 16-bit weights need every gradient before any step: the group's last
    /// iteration then runs its forward and backward twice (the first keeping only the norm).
    /// Under accumulation the earlier micro-batches add their gradients up as without.
    pub fn with_step_in_backward(mut self, on: bool) -> Self {
        self.in_backward = on.then(StepInBackward::default);
        self
    }

    /// Whether each parameter steps in backward (asked for, or by optimizer offload).
    pub fn step_in_backward(&self) -> bool {
        self.in_backward.is_some() || self.offload.is_some()
    }

    /// Before the run: the step in backward joins Burn's autodiff graph, on a backend memsave
    /// has ops for.
    pub(super) fn check_step_in_backward<M: TrainModel>(
        &self,
        state: &TrainState<M>,
    ) -> crate::Result<()> {
        if self.in_backward.is_none() {
            return Ok(());
        }
        // Optimizer offload steps in backward: its key is the one to name.
        let field = match self.offload {
            Some(_) => "offload.optimizer",
            None => "step_in_backward",
        };
        let probe = burn::tensor::Tensor::<1>::zeros([1], &state.device).into_dispatch();
        if !crate::backend::is_autodiff_float(&probe) {
            return Err(crate::Error::invalid(
                field,
                format!(
                    "needs an autodiff device, whose graph the step joins; this run's device \
                     ({:?}) is not one: pass `device.autodiff()`",
                    state.device
                ),
            ));
        }
        crate::backend::supported(&probe)
            .map_err(|error| crate::Error::invalid(field, error.to_string()))
    }

    /// Whether this iteration ends its group (steps).
    fn ends_group<M: TrainModel>(&self, state: &TrainState<M>) -> bool {
        state.every_n_iters(self.groups.cumulative_iters()) || state.is_last_iter()
    }

    /// Whether the step needs every gradient first: clipping, or an overflow check.
    fn two_passes(&self) -> bool {
        self.grad_clip.is_some() || self.mixed.is_some()
    }

    /// Before the iteration: two passes where the step in backward needs them.
    pub(super) fn plan_passes<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        if self.in_backward.is_some() && self.ends_group(state) && self.two_passes() {
            state.forward_passes = 2;
        }
    }

    /// Before a forward that ends a group: the forward model tapped for its pass (under
    /// optimizer offload, before every forward: a micro-batch that does not end its group adds
    /// its gradients to the sums on the host).
    pub(super) fn tap_forward<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        let offload = self.offloaded().then(|| state.device.clone());
        let ends_group = self.ends_group(state);
        if self.in_backward.is_none() || (!ends_group && offload.is_none()) {
            return;
        }
        let norm_pass = state.forward_passes == 2 && state.pass == 0;
        let norm_type = self.grad_clip.as_ref().map_or(2.0, |clip| clip.norm_type);
        let ib = self.in_backward.as_mut().expect("checked above");
        let coefficient = match (&self.grad_clip, ib.first_norm) {
            (Some(clip), Some(norm)) if !norm_pass => crate::grads::clip_coefficient(clip, norm),
            _ => None,
        };
        let phase = match (ends_group, norm_pass) {
            (false, _) => Phase::Accumulate,
            (true, true) => Phase::Norm,
            (true, false) => Phase::Step,
        };
        let settings = PassSettings {
            phase,
            norm_type,
            log_norm: state.forward_passes < 2,
            unscale: self
                .mixed
                .as_ref()
                .map(|mixed| 1.0 / mixed.scaler.loss_scale()),
            coefficient,
            sum_dtype: self.weights16.map(|_| DType::F32),
            lr: state.lr,
            offload,
        };
        let device = state.device.clone();
        match state.forward_model.take() {
            Some(forward) => {
                state.forward_model = Some(ib.passes.tap(forward, &device, settings));
            }
            None => state.model = ib.passes.tap(state.model.clone(), &device, settings),
        }
    }

    /// After the forward of a micro-batch that does not end its group, under optimizer
    /// offload: its backward adds each gradient to the group's sum on the host. Returns whether
    /// the iteration was one.
    pub(super) fn accumulate_pass<M: TrainModel>(&mut self, state: &mut TrainState<M>) -> bool {
        if !self.offloaded() || self.ends_group(state) {
            return false;
        }
        let Some(loss) = self.scaled_loss(state) else {
            self.untap(state);
            return true;
        };
        let sums = self.summed.take().unwrap_or_default();
        let masters = Self::host_masters::<M>(&self.offload).unwrap_or(&state.model);
        let ib = self
            .in_backward
            .as_mut()
            .expect("optimizer offload steps in backward");
        let sums = ib.passes.accumulate_pass(masters, sums, || {
            in_phase(phase::BACKWARD, || drop(crate::checkpoint::backward(loss)))
        });
        self.untap(state);
        self.summed = Some(sums);
        self.pending += 1;
        state.log.loss_scale = self.mixed.as_ref().and_then(Mixed::logged_scale);
        true
    }

    /// The model the forward ran on made plain again.
    fn untap<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        let Some(ib) = self.in_backward.as_mut() else {
            return;
        };
        match state.forward_model.take() {
            Some(forward) => state.forward_model = Some(ib.passes.untap(forward)),
            None => state.model = ib.passes.untap(state.model.clone()),
        }
    }

    /// After the first of two passes: its backward keeps the norm alone; an overflow skips the
    /// step and gives the second pass up.
    pub(super) fn norm_pass<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        let Some(loss) = self.scaled_loss(state) else {
            return;
        };
        let sums = self.summed.take().unwrap_or_default();
        let ib = self
            .in_backward
            .as_mut()
            .expect("two passes are the step in backward's");
        let masters = Self::host_masters::<M>(&self.offload).unwrap_or(&state.model);
        let (end, sums) = ib.passes.norm_pass(masters, sums, || {
            in_phase(phase::BACKWARD, || drop(crate::checkpoint::backward(loss)))
        });
        ib.first_norm = end.norm;
        self.untap(state);
        let mut reached = end.reached;
        reached.extend(crate::train::params::ids_with_grad(&state.model, &sums));
        self.summed = Some(sums);
        self.report_missing(state, &reached);
        let overflow = end.norm.is_some_and(|norm| !norm.is_finite());
        let Some(mixed) = self.mixed.as_mut().filter(|_| overflow) else {
            return;
        };
        let mut group = GroupEnd::default();
        let scale = mixed.scaler.loss_scale();
        skip_on_overflow(&mut mixed.scaler, scale, state.iter, &mut group);
        self.summed = None;
        self.pending = 0;
        for warning in group.warnings {
            state.warn(warning);
        }
        state.log.overflow = true;
        state.log.stepped = false;
        state.log.step_groups = 0;
        state.log.grad_norm = None;
        state.log.loss_scale = self.mixed.as_ref().and_then(Mixed::logged_scale);
        if let Some(ib) = self.in_backward.as_mut() {
            ib.skipped = true;
        }
        state.forward_passes = 1;
    }

    /// After the forward of an iteration that steps in backward: the step pass. Returns whether
    /// the iteration was the step in backward's (else the ordinary backward runs).
    pub(super) fn step_pass<M: TrainModel>(&mut self, state: &mut TrainState<M>) -> bool {
        let Some(ib) = self.in_backward.as_mut() else {
            return false;
        };
        if std::mem::take(&mut ib.skipped) {
            state.loss = None;
            return true;
        }
        if !ib.passes.is_tapped() {
            return false;
        }
        let Some(loss) = self.scaled_loss(state) else {
            self.untap(state);
            return true;
        };
        let two = state.forward_passes == 2;
        let sums = self.summed.take().unwrap_or_default();
        let earlier = crate::train::params::ids_with_grad(&state.model, &sums);
        let ib = self.in_backward.as_mut().expect("checked above");
        let host = Self::host_masters_mut::<M>(&mut self.offload);
        let (model, optimizer) = (&mut state.model, &mut state.optimizer);
        let end = scope(phase::STEP, || {
            ib.passes.step_pass(model, host, optimizer, sums, || {
                in_phase(phase::BACKWARD, || drop(crate::checkpoint::backward(loss)))
            })
        });
        let norm = if two { ib.first_norm.take() } else { end.norm };
        self.untap(state);
        self.pending = 0;
        if !two {
            let mut reached = end.reached;
            reached.extend(earlier);
            self.report_missing(state, &reached);
        }
        if let Some(mixed) = self.mixed.as_mut() {
            mixed.scaler.update_scale(false);
        }
        state.log.overflow = false;
        state.log.stepped = true;
        state.log.step_groups = 1;
        state.log.grad_norm = norm;
        state.log.loss_scale = self.mixed.as_ref().and_then(Mixed::logged_scale);
        self.log_rounding(state);
        self.refresh_forward(state);
        true
    }

    /// MMCV's `detect_anomalous_params` for a group: the trainable parameters `reached` lacks
    /// (neither their tap ran nor the group's earlier micro-batches gave them a gradient).
    fn report_missing<M: TrainModel>(
        &self,
        state: &mut TrainState<M>,
        reached: &std::collections::HashSet<burn::module::ParamId>,
    ) {
        if !self.detect_anomalous_params {
            return;
        }
        super::warn_no_gradient(state, params_not_reached(&state.model, reached));
    }
}
