//! The runner's hook points (MMCV's `Hook`, with MMEngine's checkpoint points) and the order
//! hooks run in (MMCV's priorities).

use std::path::Path;

use super::state::{TrainModel, TrainState};
use crate::snapshot::SnapshotMeta;
use crate::Result;

pub use memsave_common::train::Priority;

/// A policy that acts at the runner's hook points.
pub trait Hook<M: TrainModel> {
    /// The name its state is saved under in snapshots.
    fn name(&self) -> &'static str;

    /// Once, before the first iteration (after a resume).
    fn before_run(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// At the start of each epoch.
    fn before_epoch(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// Before each iteration's forward.
    fn before_iter(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// Right before each forward of the iteration (twice where a hook asked for two passes,
    /// [`TrainState::forward_passes`]; [`TrainState::pass`] says which), after the batch is made.
    fn before_forward(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// After the first forward of an iteration of two passes (`state.loss` is set): the first
    /// pass's backward. Setting [`TrainState::forward_passes`] to 1 gives the second pass up
    /// (an overflow): `after_iter` follows at once.
    fn after_first_pass(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// After each iteration's forward (`state.loss` is set; the second one's, in two passes).
    fn after_iter(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// Once, where the run ends with an error (a hook's, a step's): the hook puts back in
    /// the state what it holds elsewhere during the run (the optimizer hook's fp32 weights
    /// under optimizer offload), so that the model the runner gives back is whole.
    fn after_failure(&mut self, _state: &mut TrainState<M>) {}

    /// At the end of each epoch.
    fn after_epoch(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// Once, after the last iteration.
    fn after_run(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// When a snapshot is due after this iteration, before it is written
    /// ([`TrainState::snapshot_due`]).
    fn before_snapshot(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        Ok(())
    }

    /// State to keep in snapshots.
    fn state_dict(&self) -> Option<serde_json::Value> {
        None
    }

    /// Restores the state from a snapshot.
    fn load_state_dict(&mut self, _value: serde_json::Value) -> Result<()> {
        Ok(())
    }

    /// The model a snapshot holds in place of [`TrainState::model`], where this hook keeps the
    /// trained weights elsewhere during the run (the optimizer hook's masters on the host under
    /// optimizer offload and mixed precision). `None`: the state's model.
    fn snapshot_model(&self, _state: &TrainState<M>) -> Option<M> {
        None
    }

    /// Before a snapshot's header is written: what the hook records there beside its state
    /// (MMEngine's `before_save_checkpoint`; the optimizer hook writes the precision).
    fn before_save(&self, _meta: &mut SnapshotMeta) {}

    /// After a snapshot from `path` was loaded into the state (MMEngine's
    /// `after_load_checkpoint`): a hook compares what it needs with the header.
    fn after_load(
        &mut self,
        _state: &mut TrainState<M>,
        _meta: &SnapshotMeta,
        _path: &Path,
    ) -> Result<()> {
        Ok(())
    }

    /// After the runner wrote a snapshot to `path` (whole, renamed into place).
    fn after_save(&mut self, _state: &mut TrainState<M>, _path: &Path) -> Result<()> {
        Ok(())
    }
}

/// The hooks of a run, in the order they run.
pub(super) struct Hooks<M: TrainModel> {
    hooks: Vec<(Priority, Box<dyn Hook<M>>)>,
}

impl<M: TrainModel> Hooks<M> {
    pub(super) fn new() -> Self {
        Hooks { hooks: Vec::new() }
    }

    /// Adds `hook` after every hook of its priority or a higher one.
    pub(super) fn insert(&mut self, hook: Box<dyn Hook<M>>, priority: Priority) {
        let at = self
            .hooks
            .iter()
            .position(|(other, _)| *other > priority)
            .unwrap_or(self.hooks.len());
        self.hooks.insert(at, (priority, hook));
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &dyn Hook<M>> {
        self.hooks.iter().map(|(_, hook)| &**hook)
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Box<dyn Hook<M>>> {
        self.hooks.iter_mut().map(|(_, hook)| hook)
    }

    /// Calls `f` on every hook, in order; the first error stops.
    pub(super) fn call(
        &mut self,
        state: &mut TrainState<M>,
        mut f: impl FnMut(&mut dyn Hook<M>, &mut TrainState<M>) -> Result<()>,
    ) -> Result<()> {
        for (_, hook) in &mut self.hooks {
            f(&mut **hook, state)?;
        }
        Ok(())
    }
}
