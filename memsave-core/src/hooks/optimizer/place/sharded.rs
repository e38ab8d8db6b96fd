//! The step after a backward that averages each gradient over the peers as it is made, kept by
//! the peer that owns its parameter only (ZeRO stage 2): no peer holds the whole set of
//! gradients. The group's last micro-batch's forward runs on tapped parameters
//! ([`crate::train::tapping`]); the ordinary step then runs on this peer's part.

use burn::tensor::backend::AutodiffBackend;

use super::super::parts::Parts;
use super::super::Reducer;
use super::StepPlace;
use crate::memory;
use crate::train::tapping::Phase;
use crate::train::{TrainModel, TrainState};
use crate::Result;

/// ZeRO stage 2's place: the step after a backward that reduces to the owners.
#[derive(Clone, Copy, Debug, Default)]
pub(in super::super) struct ShardedByOwner;

impl StepPlace for ShardedByOwner {
    fn before_last_iter<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        super::tap(parts, state, Phase::Reduce, 2.0, false);
        Ok(())
    }

    fn end_group<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        let mut tapping = std::mem::take(&mut state.tapping);
        let Some(loss) = state.loss.take() else {
            tapping.untap(state);
            state.tapping = tapping;
            return Ok(());
        };
        let outcome = (|| {
            parts.log_loss(state, &loss)?;
            let loss = parts.loss_to_backward(state, loss);
            let mixed = parts.is_mixed();
            let summed = parts.summed.take();
            *parts.pending = 0;
            memory::in_phase(memory::phase::BACKWARD, || {
                tapping.reduce_pass(state, loss, summed, mixed)
            })
        })();
        tapping.untap(state);
        state.tapping = tapping;
        let (grads, reached) = outcome?;
        parts.warn_missing(state, &reached);
        memory::scope(memory::phase::STEP, || parts.step(state, grads))
    }
}
