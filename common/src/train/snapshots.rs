//! When the runner writes snapshots (MMCV's `checkpoint_config`), their names, and which old
//! ones go. Each runtime's `SnapshotHook` asks a [`SnapshotSchedule`] and has its runner write.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use smart_default::SmartDefault;

use super::At;

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

/// When snapshots are due, what they are called, and which old ones go (MMCV's
/// `CheckpointHook`).
#[derive(Clone, Debug)]
pub struct SnapshotSchedule {
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

impl SnapshotSchedule {
    /// Every `interval` epochs (`by_epoch`) or iterations, and at the end; keeps all.
    pub fn new(interval: usize, by_epoch: bool) -> Self {
        SnapshotSchedule {
            interval,
            by_epoch,
            save_last: true,
            max_keep: None,
            saved_at: None,
            saved: Vec::new(),
        }
    }

    /// The schedule of `config` for a run counted in epochs or not (`runner_by_epoch`).
    pub fn from_config(config: &SnapshotConfig, runner_by_epoch: bool) -> Self {
        SnapshotSchedule {
            save_last: config.save_last,
            max_keep: usize::try_from(config.max_keep_ckpts).ok(),
            ..Self::new(config.interval, config.by_epoch.unwrap_or(runner_by_epoch))
        }
    }

    /// After iteration `at`: whether a snapshot counted in iterations is due.
    pub fn due_after_iter(&self, at: &At) -> bool {
        !self.by_epoch && self.interval > 0 && at.every_n_iters(self.interval)
    }

    /// At the end of `at`'s epoch: whether a snapshot counted in epochs is due.
    pub fn due_after_epoch(&self, at: &At) -> bool {
        self.by_epoch && self.interval > 0 && (at.epoch + 1).is_multiple_of(self.interval)
    }

    /// After the run: whether the last snapshot is still to write.
    pub fn due_after_run(&self, max_iters: usize) -> bool {
        self.save_last && self.saved_at != Some(max_iters)
    }

    /// A snapshot due after iteration `at`: its file name (`epoch_N.ckpt`, `iter_N.ckpt`),
    /// the run counted as at that point.
    pub fn name(&mut self, at: &At) -> String {
        let completed = (at.iter + 1).min(at.max_iters);
        self.saved_at = Some(completed);
        if self.by_epoch {
            format!("epoch_{}.ckpt", completed / at.iters_per_epoch)
        } else {
            format!("iter_{completed}.ckpt")
        }
    }

    /// Once a snapshot is whole on disk at `path`, the oldest beyond `max_keep` go (never
    /// the one just written, which `latest.ckpt` names).
    pub fn saved(&mut self, path: &Path) {
        self.saved.retain(|saved| saved != path);
        self.saved.push(path.to_path_buf());
        let Some(keep) = self.max_keep else {
            return;
        };
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
}
