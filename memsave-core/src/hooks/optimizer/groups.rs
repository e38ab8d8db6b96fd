//! The grouping part of the optimizer hook: micro-batches per optimizer step (MMCV's
//! `cumulative_iters`) and the loss factor of each.

use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use crate::train::params::has_batch_norm;
use crate::train::{TrainModel, TrainState};
use crate::{Error, Result};

/// The grouping part: micro-batches per optimizer step, and MMCV's loss factor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Groups {
    cumulative_iters: usize,
}

impl Groups {
    /// A step every iteration (`cumulative_iters = 1`).
    pub const EVERY_ITERATION: Groups = Groups {
        cumulative_iters: 1,
    };

    /// Steps every `cumulative_iters` iterations; 0 is an error naming `cumulative_iters`.
    pub fn new(cumulative_iters: usize) -> Result<Self> {
        if cumulative_iters == 0 {
            return Err(Error::invalid(
                "cumulative_iters",
                "must be a positive integer, got 0",
            ));
        }
        Ok(Groups { cumulative_iters })
    }

    /// Micro-batches per step.
    pub fn cumulative_iters(self) -> usize {
        self.cumulative_iters
    }

    /// What the loss of iteration `iter` is divided by: `cumulative_iters` in the full groups,
    /// the size of the final short group in it (REFERENCE.md section 2).
    pub fn loss_factor(self, iter: usize, max_iters: usize) -> usize {
        let remainder = max_iters % self.cumulative_iters;
        if iter < max_iters - remainder {
            self.cumulative_iters
        } else {
            remainder
        }
    }

    /// Whether the optimizer steps after iteration `state.iter`.
    pub(super) fn boundary<B: AutodiffBackend, M: TrainModel<B>>(
        self,
        state: &TrainState<B, M>,
    ) -> bool {
        state.every_n_iters(self.cumulative_iters) || state.is_last_iter()
    }

    /// Whether iteration `iter` (from 0) of a run of `max_iters` ends a group: the optimizer
    /// steps after it (MMCV's `every_n_iters(cumulative_iters) or is_last_iter`).
    pub fn ends_group(self, iter: usize, max_iters: usize) -> bool {
        (iter + 1).is_multiple_of(self.cumulative_iters) || iter + 1 == max_iters
    }

    /// MMCV's two warnings, at the start of a run.
    pub(super) fn warn<B: AutodiffBackend, M: TrainModel<B>>(self, state: &mut TrainState<B, M>) {
        if self.cumulative_iters == 1 {
            return;
        }
        if !state.iter.is_multiple_of(self.cumulative_iters) {
            state.warn(format!(
                "resuming at iteration {}, which is not a multiple of cumulative_iters ({}): the \
                 gradients of the first {} iterations of this group are lost, which may change \
                 the result slightly",
                state.iter,
                self.cumulative_iters,
                state.iter % self.cumulative_iters
            ));
        }
        if has_batch_norm::<B, M>(&state.model) {
            state.warn(format!(
                "the model has BatchNorm layers: with cumulative_iters = {}, their batch \
                 statistics see one micro-batch at a time, which may lower the result slightly",
                self.cumulative_iters
            ));
        }
    }
}
