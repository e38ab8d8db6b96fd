//! The step after backward (MMCV's): the group's last backward makes every gradient, they are
//! averaged over the peers, and the optimizer steps on them ([`Parts::step`]).

use burn::tensor::backend::AutodiffBackend;

use super::super::parts::{warn_without_gradient, Parts};
use super::super::Reducer;
use super::StepPlace;
use crate::memory;
use crate::train::grads;
use crate::train::{TrainModel, TrainState};
use crate::Result;

/// The step after backward.
#[derive(Clone, Copy, Debug, Default)]
pub(in super::super) struct AfterBackward;

impl StepPlace for AfterBackward {
    fn end_group<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        let Some(mut grads) = parts.backward_into_sums(state)? else {
            return Ok(());
        };
        *parts.pending = 0;
        memory::scope(memory::phase::STEP, || {
            // The mean over the peers, once per group, before anything reads the gradients
            // (the norm, the overflow check, clipping); every peer gets the same bits.
            parts.reducer.mean_grads(&state.model, &mut grads)?;
            if parts.detect_anomalous_params {
                let missing = grads::params_without_grad::<B, M>(&state.model, &grads);
                warn_without_gradient(state, missing);
            }
            parts.step(state, grads)
        })
    }
}
