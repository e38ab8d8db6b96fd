use burn::tensor::backend::AutodiffBackend;

use crate::train::{Hook, TrainModel, TrainState};
use crate::Result;

/// Saves checkpoints every `interval` epochs (or iterations) and at the end of the run
/// (MMCV's `CheckpointHook`), as `epoch_N.ckpt` / `iter_N.ckpt` in the work directory, plus
/// `latest.ckpt`.
#[derive(Clone, Debug)]
pub struct CheckpointHook {
    /// Every this many epochs or iterations; 0: only at the end.
    pub interval: usize,
    /// Count `interval` in epochs (else iterations).
    pub by_epoch: bool,
    /// Also save after the last iteration.
    pub save_last: bool,
    saved_at: Option<usize>,
}

impl CheckpointHook {
    /// Saves every `interval` epochs (`by_epoch`) or iterations, and at the end.
    pub fn new(interval: usize, by_epoch: bool) -> Self {
        CheckpointHook {
            interval,
            by_epoch,
            save_last: true,
            saved_at: None,
        }
    }

    fn request<B: AutodiffBackend, M: TrainModel<B>>(&mut self, state: &mut TrainState<B, M>) {
        let completed = (state.iter + 1).min(state.max_iters);
        let name = if self.by_epoch {
            format!("epoch_{}.ckpt", completed / state.iters_per_epoch)
        } else {
            format!("iter_{completed}.ckpt")
        };
        state.save_request = Some(state.work_dir.join(name));
        self.saved_at = Some(completed);
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for CheckpointHook {
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
}
