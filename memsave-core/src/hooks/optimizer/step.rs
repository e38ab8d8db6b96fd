//! The end of a group after backward: the norm, the overflow check (half precision), clipping,
//! and the step or its skip; each peer's part under ZeRO, then the new values shared.

use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use super::parts::Parts;
use super::Reducer;
use crate::train::grads;
use crate::train::{TrainModel, TrainState};
use crate::Result;

impl<R> Parts<'_, R> {
    /// Steps on the group's gradients `grads` (averaged over the peers already), or skips the
    /// step on overflow (MMCV's order: unscale, check, clip, step, update the scaler).
    pub(super) fn step<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
        mut grads: GradientsParams,
    ) -> Result<()>
    where
        R: Reducer<B>,
    {
        // ZeRO: the gradients another peer steps go, at once at stage 2 (the norm is then
        // gathered from the owners), after the norm at stage 1.
        self.reducer.keep_own_before_norm(&state.model, &mut grads);
        let norm_type = self.norm_type();
        let grad_clip = self.grad_clip;
        let Some(mixed) = self.mixed.as_deref_mut() else {
            let norm = self.reducer.global_norm(&state.model, &grads, norm_type)?;
            self.reducer.keep_own(&state.model, &mut grads);
            if let (Some(clip), Some(norm)) = (grad_clip, norm) {
                let coefficient = clip.max_norm / (norm + 1e-6);
                if norm.is_finite() && coefficient < 1.0 {
                    grads::scale::<B, M>(&state.model, &mut grads, coefficient);
                }
            }
            state.log.grad_norm = norm;
            state.step(grads);
            return self.reducer.share_stepped(&mut state.model);
        };
        // The gradients are still half (one micro-batch) or fp32 sums (accumulation), and
        // scaled. Their norm is taken as they are and unscaled after (the same value, for a
        // power-of-two scale); each chunk of parameters is then cast, unscaled and clipped just
        // before it steps, in the order a full fp32 copy would have been.
        let scale = mixed.scaler.loss_scale();
        let norm = self
            .reducer
            .global_norm(&state.model, &grads, norm_type)?
            .map(|n| n / scale);
        // One non-finite gradient on any peer skips the step on every peer.
        let overflow = self
            .reducer
            .any(norm.is_some_and(|norm| !norm.is_finite()))?;
        if overflow {
            mixed.skip_overflow(state);
            return Ok(());
        }
        state.log.grad_norm = norm;
        let clip = match (grad_clip, norm) {
            (Some(clip), Some(norm)) => Some(clip.max_norm / (norm + 1e-6)),
            _ => None,
        }
        .filter(|&coefficient| coefficient < 1.0);
        self.reducer.keep_own(&state.model, &mut grads);
        // Each chunk of parameters the optimizer steps at once.
        state.step_with(grads, &mut |model, chunk| {
            grads::to_f32::<B, M>(model, chunk);
            grads::scale::<B, M>(model, chunk, 1.0 / scale);
            if let Some(coefficient) = clip {
                grads::scale::<B, M>(model, chunk, coefficient);
            }
        });
        self.reducer.share_stepped(&mut state.model)?;
        mixed.refresh_forward(state);
        mixed.stepped(state);
        Ok(())
    }
}
