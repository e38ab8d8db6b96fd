use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;
use serde::Deserialize;
use smart_default::SmartDefault;

use crate::train::{Hook, TrainModel, TrainState};
use crate::Result;

/// When to save snapshots (MMCV's `checkpoint_config`): every `interval` epochs (or
/// iterations) and at the end of the run, as `epoch_N.ckpt` / `iter_N.ckpt` in the work
/// directory, with `latest.ckpt` beside them; only the newest `max_keep_ckpts` are kept.
#[derive(Clone, Debug, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct SnapshotConfig {
    /// Every this many epochs or iterations; 0: only at the end.
    #[default(1)]
    pub interval: usize,
    /// Count `interval` in epochs (else iterations); `None`: as the runner counts.
    pub by_epoch: Option<bool>,
    /// Also save after the last iteration.
    #[default(true)]
    pub save_last: bool,
    /// Keep only the newest this many numbered snapshots of the run (MMCV's
    /// `max_keep_ckpts`); -1 keeps all.
    #[default(-1)]
    pub max_keep_ckpts: i64,
}

/// Saves snapshots as its [`SnapshotConfig`] says (MMCV's `CheckpointHook`).
#[derive(Clone, Debug)]
pub struct SnapshotHook {
    /// Every this many epochs or iterations; 0: only at the end.
    pub interval: usize,
    /// Count `interval` in epochs (else iterations).
    pub by_epoch: bool,
    /// Also save after the last iteration.
    pub save_last: bool,
    /// Keep only the newest this many numbered snapshots; `None` keeps all.
    pub max_keep: Option<usize>,
    saved_at: Option<usize>,
    saved: Vec<PathBuf>,
}

impl SnapshotHook {
    /// Saves every `interval` epochs (`by_epoch`) or iterations, and at the end; keeps all.
    pub fn new(interval: usize, by_epoch: bool) -> Self {
        SnapshotHook {
            interval,
            by_epoch,
            save_last: true,
            max_keep: None,
            saved_at: None,
            saved: Vec::new(),
        }
    }

    /// The hook of `config` for a run counted in epochs or not (`runner_by_epoch`).
    pub fn from_config(config: &SnapshotConfig, runner_by_epoch: bool) -> Self {
        SnapshotHook {
            save_last: config.save_last,
            max_keep: usize::try_from(config.max_keep_ckpts).ok(),
            ..Self::new(config.interval, config.by_epoch.unwrap_or(runner_by_epoch))
        }
    }

    fn request<B: AutodiffBackend, M: TrainModel<B>>(&mut self, state: &mut TrainState<B, M>) {
        let completed = (state.iter + 1).min(state.max_iters);
        // Every peer knows a snapshot is due (a sharded state is gathered by all of them).
        self.saved_at = Some(completed);
        state.snapshot_due = true;
        if !state.is_main() {
            // Rank 0 writes the snapshots of a data-parallel run.
            return;
        }
        let name = if self.by_epoch {
            format!("epoch_{}.ckpt", completed / state.iters_per_epoch)
        } else {
            format!("iter_{completed}.ckpt")
        };
        state.save_request = Some(state.work_dir.join(name));
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for SnapshotHook {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if !self.by_epoch && self.interval > 0 && state.every_n_iters(self.interval) {
            self.request(state);
        }
        Ok(())
    }

    fn after_epoch(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if self.by_epoch && self.interval > 0 && (state.epoch + 1).is_multiple_of(self.interval) {
            self.request(state);
        }
        Ok(())
    }

    fn after_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if self.save_last && self.saved_at != Some(state.max_iters) {
            state.iter = state.max_iters - 1;
            self.request(state);
            state.iter = state.max_iters;
        }
        Ok(())
    }

    /// Once a snapshot is whole on disk, the oldest beyond `max_keep` go (never the one just
    /// written, which `latest.ckpt` names).
    fn after_save(&mut self, _state: &mut TrainState<B, M>, path: &std::path::Path) -> Result<()> {
        self.saved.retain(|saved| saved != path);
        self.saved.push(path.to_path_buf());
        if let Some(keep) = self.max_keep {
            let keep = keep.max(1);
            while self.saved.len() > keep {
                let old = self.saved.remove(0);
                // Already gone (removed by hand) is fine; anything else is worth a word.
                if let Err(error) = std::fs::remove_file(&old) {
                    if error.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(
                            target: "memsave",
                            path = %old.display(),
                            "could not remove the old snapshot {}: {error}",
                            old.display()
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
