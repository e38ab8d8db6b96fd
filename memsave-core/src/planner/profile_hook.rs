//! The profiling hook: one iteration recorded as a [`Profile`], every segment checkpointed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use burn::tensor::backend::AutodiffBackend;

use super::Profile;
use crate::checkpoint::{CheckpointModule, SegmentId};
use crate::memory::Meter;
use crate::train::params::trainable_layout;
use crate::train::{Hook, TrainModel, TrainState};
use crate::Result;
use memsave_common::planner::Recording;

/// Each segment of `model` by identity, to its module path.
pub(crate) fn segment_ids<M: CheckpointModule>(model: &M) -> HashMap<SegmentId, String> {
    let mut ids = HashMap::new();
    model.visit_segments("", &mut |path, id| {
        ids.insert(id, path.to_string());
    });
    ids
}

/// Sets every segment of the model, and of the forward copy under mixed precision (and of the
/// fp32 model whose masters are on the host), by `on`.
pub(super) fn set_flags<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule>(
    state: &mut TrainState<B, M>,
    on: &dyn Fn(&str) -> bool,
) {
    state.model = state.model.clone().set_with_cp_by_path("", on);
    if let Some(forward) = state.forward_model.take() {
        state.forward_model = Some(forward.set_with_cp_by_path("", on));
    }
    if let Some(skeleton) = state.masters_on_host.take() {
        state.masters_on_host = Some(skeleton.set_with_cp_by_path("", on));
    }
}

/// Records the profile of one iteration ([`Profile`]); the model runs with every segment
/// checkpointed in it, and its flags are left so. `memsave plan` and the bench use it.
pub struct ProfileHook {
    /// The iteration to profile.
    pub iter: usize,
    /// The profile, once taken.
    pub profile: Rc<RefCell<Option<Profile>>>,
    /// Whether the profiled iteration runs with every segment checkpointed (the planner's
    /// profile), else as the model stands (a measurement of it).
    pub checkpoint_all: bool,
    meter: Option<Box<dyn Meter>>,
    recording: Option<Recording>,
}

impl ProfileHook {
    /// Profiles iteration `iter` with every segment checkpointed, memory read by `meter`.
    pub fn new(iter: usize, meter: Box<dyn Meter>) -> Self {
        ProfileHook {
            iter,
            profile: Rc::new(RefCell::new(None)),
            checkpoint_all: true,
            meter: Some(meter),
            recording: None,
        }
    }

    pub(super) fn begin<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) {
        if self.checkpoint_all {
            set_flags(state, &|_| true);
        }
        let ids = segment_ids(state.forward_model());
        self.recording = Some(match self.meter.take() {
            Some(meter) => Recording::begin(meter, ids, super::dynamic::staged()),
            // A retry (see `skipped`): the recording goes on, afresh.
            None => Recording::again(ids, super::dynamic::staged()),
        });
    }

    /// Whether the profiled step `state` ends was skipped on a gradient overflow (a dynamic
    /// loss scale's first, high scales; with the step in backward its second pass never ran):
    /// not the step a plan is for. The recording is kept on for the next iteration, which is
    /// profiled instead.
    pub(super) fn skipped<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &TrainState<B, M>,
    ) -> bool {
        if !state.log.overflow {
            return false;
        }
        self.iter = state.iter + 1;
        true
    }

    /// The profiled step's first pass ended (of two): the profile is of the second, and keeps
    /// the first's time. The segments are named afresh: the second forward runs on the model
    /// the optimizer hook has made for it.
    pub(super) fn first_pass_done<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule>(
        &mut self,
        state: &TrainState<B, M>,
    ) {
        if let Some(recording) = self.recording.as_mut() {
            recording.first_pass_done(segment_ids(state.forward_model()));
        }
    }

    /// The profile of the step [`ProfileHook::begin`] started; `None` where none was begun.
    pub(super) fn end<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule>(
        &mut self,
        state: &TrainState<B, M>,
    ) -> Option<Profile> {
        let recording = self.recording.take()?;
        // The trainable bytes in fp32 (the optimizer state's and the sums' unit): the masters',
        // on the host under mixed precision with optimizer offload, where the model is the half
        // copy; four bytes a weight where the weights are in 16 bits.
        let trainable = crate::train::params::trainable_elements::<B, M>(&state.model) * 4;
        // The gradients are the forward model's (half under mixed precision).
        Some(recording.end(trainable, trainable_layout::<B, M>(state.forward_model())))
    }
}

impl<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule> Hook<B, M> for ProfileHook {
    fn name(&self) -> &'static str {
        "profile"
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.iter {
            self.begin(state);
        }
        Ok(())
    }

    fn after_first_pass(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.iter {
            self.first_pass_done(state);
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.iter && !self.skipped(state) {
            *self.profile.borrow_mut() = self.end(state);
        }
        Ok(())
    }
}
