//! The grouping part of the optimizer hook: micro-batches per optimizer step (MMCV's
//! `cumulative_iters`, [`Groups`], Burn-free in memsave-common) and what the runner does with
//! them.

use burn::tensor::backend::AutodiffBackend;

use crate::train::params::has_batch_norm;
use crate::train::{TrainModel, TrainState};

pub use memsave_common::groups::Groups;

/// Whether the optimizer steps after iteration `state.iter`.
pub(super) fn boundary<B: AutodiffBackend, M: TrainModel<B>>(
    groups: Groups,
    state: &TrainState<B, M>,
) -> bool {
    state.every_n_iters(groups.cumulative_iters()) || state.is_last_iter()
}

/// MMCV's two warnings, at the start of a run.
pub(super) fn warn<B: AutodiffBackend, M: TrainModel<B>>(
    groups: Groups,
    state: &mut TrainState<B, M>,
) {
    let cumulative_iters = groups.cumulative_iters();
    if cumulative_iters == 1 {
        return;
    }
    if !state.iter.is_multiple_of(cumulative_iters) {
        state.warn(format!(
            "resuming at iteration {}, which is not a multiple of cumulative_iters ({}): the \
             gradients of the first {} iterations of this group are lost, which may change \
             the result slightly",
            state.iter,
            cumulative_iters,
            state.iter % cumulative_iters
        ));
    }
    if has_batch_norm::<B, M>(&state.model) {
        state.warn(format!(
            "the model has BatchNorm layers: with cumulative_iters = {}, their batch \
             statistics see one micro-batch at a time, which may lower the result slightly",
            cumulative_iters
        ));
    }
}
