//! The runner's hook points (MMCV's `Hook`, with MMEngine's checkpoint points) and the order
//! hooks run in (MMCV's priorities).

use std::path::Path;

use burn::tensor::backend::AutodiffBackend;

use super::snapshot::SnapshotMeta;
use super::state::{TrainModel, TrainState};
use crate::Result;

pub use memsave_common::train::Priority;

/// A policy that acts at the runner's hook points.
pub trait Hook<B: AutodiffBackend, M: TrainModel<B>> {
    /// The name its state is saved under in snapshots.
    fn name(&self) -> &'static str;

    /// Once, before the first iteration (after a resume).
    fn before_run(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// At the start of each epoch.
    fn before_epoch(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// Before each iteration's forward.
    fn before_iter(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// After each iteration's forward (`state.loss` is set); once an iteration, after its
    /// last forward when it runs two ([`TrainState::forward_passes`]).
    fn after_iter(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// After the first forward of an iteration that runs two ([`TrainState::forward_passes`],
    /// `state.loss` is set): the optimizer hook's first backward. `after_iter` follows the
    /// second.
    fn after_first_pass(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// At the end of each epoch.
    fn after_epoch(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// Once, after the last iteration.
    fn after_run(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// On every peer, when a snapshot is due after this iteration, before rank 0 writes it
    /// ([`TrainState::snapshot_due`]): the optimizer hook gathers an optimizer state sharded
    /// across the peers here. Every peer calls the same collectives.
    fn before_snapshot(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
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

    /// Before a snapshot's header is written: what the hook records there beside its state
    /// (MMEngine's `before_save_checkpoint`; the optimizer hook writes the precision).
    fn before_save(&self, _meta: &mut SnapshotMeta) {}

    /// After a snapshot from `path` was loaded into the state (MMEngine's
    /// `after_load_checkpoint`): a hook compares what it needs with the header.
    fn after_load(
        &mut self,
        _state: &mut TrainState<B, M>,
        _meta: &SnapshotMeta,
        _path: &Path,
    ) -> Result<()> {
        Ok(())
    }

    /// After the runner wrote a snapshot to `path` (whole, renamed into place).
    fn after_save(&mut self, _state: &mut TrainState<B, M>, _path: &Path) -> Result<()> {
        Ok(())
    }

    /// What to add to the advice when a step does not fit the device's memory (before the
    /// run, from the sizes known up front, or when the device's allocator gave up): the config
    /// layer names the keys of the strategies, the planner what its profile predicts would fit.
    fn out_of_memory_advice(&self, _state: &TrainState<B, M>) -> Option<String> {
        None
    }

    /// The shares of the gradients and of the optimizer state this peer holds (ZeRO: 1/N of
    /// what it shards), for the memory check before the run; `(1.0, 1.0)`: all of both.
    fn held_shares(&self, _state: &TrainState<B, M>) -> (f64, f64) {
        (1.0, 1.0)
    }
}

/// The hooks of a run, in the order they run.
pub(super) struct Hooks<B: AutodiffBackend, M: TrainModel<B>> {
    hooks: Vec<(Priority, Box<dyn Hook<B, M>>)>,
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hooks<B, M> {
    pub(super) fn new() -> Self {
        Hooks { hooks: Vec::new() }
    }

    /// Adds `hook` after every hook of its priority or a higher one.
    pub(super) fn insert(&mut self, hook: Box<dyn Hook<B, M>>, priority: Priority) {
        let at = self
            .hooks
            .iter()
            .position(|(other, _)| *other > priority)
            .unwrap_or(self.hooks.len());
        self.hooks.insert(at, (priority, hook));
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &dyn Hook<B, M>> {
        self.hooks.iter().map(|(_, hook)| &**hook)
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Box<dyn Hook<B, M>>> {
        self.hooks.iter_mut().map(|(_, hook)| hook)
    }

    /// Calls `f` on every hook, in order; the first error stops.
    pub(super) fn call(
        &mut self,
        state: &mut TrainState<B, M>,
        mut f: impl FnMut(&mut dyn Hook<B, M>, &mut TrainState<B, M>) -> Result<()>,
    ) -> Result<()> {
        for (_, hook) in &mut self.hooks {
            f(&mut **hook, state)?;
        }
        Ok(())
    }

    /// The shares of the gradients and of the optimizer state this peer holds (the smallest
    /// any hook says).
    pub(super) fn held_shares(&self, state: &TrainState<B, M>) -> (f64, f64) {
        self.iter()
            .map(|hook| hook.held_shares(state))
            .fold((1.0, 1.0), |(g, s), (hg, hs)| (g.min(hg), s.min(hs)))
    }

    /// Every hook's advice for a step that does not fit, joined.
    pub(super) fn out_of_memory_advice(&self, state: &TrainState<B, M>) -> Vec<String> {
        self.iter()
            .filter_map(|hook| hook.out_of_memory_advice(state))
            .collect()
    }
}
