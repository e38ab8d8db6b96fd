//! The snapshot hook (MMCV's `CheckpointHook`): when and under which name, from
//! memsave-common's [`SnapshotSchedule`]; the runner writes them.

use crate::train::{Hook, TrainModel, TrainState};
use crate::Result;

pub use memsave_common::train::{SnapshotConfig, SnapshotSchedule};

/// Saves snapshots as its [`SnapshotConfig`] says: every `interval` epochs or iterations and
/// at the end, as `epoch_N.ckpt` / `iter_N.ckpt` in the work directory with `latest.ckpt`
/// beside them, the newest `max_keep` kept. Its [`SnapshotSchedule`] (whose fields it derefs
/// to) says when.
#[derive(Clone, Debug)]
pub struct SnapshotHook(SnapshotSchedule);

impl SnapshotHook {
    /// Saves every `interval` epochs (`by_epoch`) or iterations, and at the end; keeps all.
    pub fn new(interval: usize, by_epoch: bool) -> Self {
        SnapshotHook(SnapshotSchedule::new(interval, by_epoch))
    }

    /// The hook of `config` for a run counted in epochs or not (`runner_by_epoch`).
    pub fn from_config(config: &SnapshotConfig, runner_by_epoch: bool) -> Self {
        SnapshotHook(SnapshotSchedule::from_config(config, runner_by_epoch))
    }

    fn request<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        let name = self.0.name(&state.at());
        state.snapshot_due = true;
        if state.is_main() {
            state.save_request = Some(state.work_dir.join(name));
        }
    }
}

impl std::ops::Deref for SnapshotHook {
    type Target = SnapshotSchedule;

    fn deref(&self) -> &SnapshotSchedule {
        &self.0
    }
}

impl std::ops::DerefMut for SnapshotHook {
    fn deref_mut(&mut self) -> &mut SnapshotSchedule {
        &mut self.0
    }
}

impl<M: TrainModel> Hook<M> for SnapshotHook {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn after_iter(&mut self, state: &mut TrainState<M>) -> Result<()> {
        if self.0.due_after_iter(&state.at()) {
            self.request(state);
        }
        Ok(())
    }

    fn after_epoch(&mut self, state: &mut TrainState<M>) -> Result<()> {
        if self.0.due_after_epoch(&state.at()) {
            self.request(state);
        }
        Ok(())
    }

    fn after_run(&mut self, state: &mut TrainState<M>) -> Result<()> {
        if self.0.due_after_run(state.max_iters) {
            state.iter = state.max_iters - 1;
            self.request(state);
            state.iter = state.max_iters;
        }
        Ok(())
    }

    fn after_save(&mut self, _state: &mut TrainState<M>, path: &std::path::Path) -> Result<()> {
        self.0.saved(path);
        Ok(())
    }
}
