//! The hook's parts as the place of the step sees them ([`Parts`]): precision, grouping,
//! reduction and clipping, and what every place does with them alike (the loss logged, the
//! backward into the group's sums, the warnings of parameters without a gradient).

use std::collections::HashSet;

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use super::precision::{self, Mixed};
use super::{Groups, Reducer};
use crate::memory;
use crate::train::grads::{self, GradClip};
use crate::train::{tapping, TrainModel, TrainState};
use crate::Result;

/// The optimizer hook's parts other than the place of the step, borrowed for one call.
pub(super) struct Parts<'a, R> {
    pub(super) grad_clip: Option<&'a GradClip>,
    pub(super) detect_anomalous_params: bool,
    pub(super) mixed: Option<&'a mut Mixed>,
    pub(super) groups: Groups,
    /// The gradients of the current group so far.
    pub(super) summed: &'a mut Option<GradientsParams>,
    /// Micro-batches summed in the current group.
    pub(super) pending: &'a mut usize,
    pub(super) reducer: &'a R,
}

impl<R> Parts<'_, R> {
    /// The norm clipping uses (2 without clipping, for the log).
    pub(super) fn norm_type(&self) -> f64 {
        self.grad_clip.map_or(2.0, |clip| clip.norm_type)
    }

    /// Whether the forward runs in half precision.
    pub(super) fn is_mixed(&self) -> bool {
        self.mixed.is_some()
    }

    /// The loss backward starts from: divided by MMCV's loss factor, scaled under mixed
    /// precision.
    pub(super) fn loss_to_backward<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &TrainState<B, M>,
        loss: Tensor<B, 1>,
    ) -> Tensor<B, 1> {
        precision::loss_to_backward(self.mixed.as_deref(), self.groups, state, loss)
    }

    /// The iteration's loss into the log, as the mean over the peers (MMDetection's
    /// `_parse_losses`).
    pub(super) fn log_loss<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &mut TrainState<B, M>,
        loss: &Tensor<B, 1>,
    ) -> Result<()>
    where
        R: Reducer<B>,
    {
        state.log.loss = Some(grads::scalar(loss));
        self.reducer.mean_for_log(&mut state.log)
    }

    /// Warns of the trainable parameters that got no gradient in backward (those not in
    /// `reached`), where `detect_anomalous_params` asks.
    pub(super) fn warn_missing<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &mut TrainState<B, M>,
        reached: &HashSet<ParamId>,
    ) {
        if self.detect_anomalous_params {
            let missing = tapping::missing::<B, M>(&state.model, reached);
            warn_without_gradient(state, missing);
        }
    }

    /// The iteration's loss logged and back-propagated, its gradients added to the group's
    /// (in the backward pass itself, see [`grads::backward`]); `None` without a loss.
    pub(super) fn backward_into_sums<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) -> Result<Option<GradientsParams>>
    where
        R: Reducer<B>,
    {
        let Some(loss) = state.loss.take() else {
            return Ok(None);
        };
        self.log_loss(state, &loss)?;
        let divisor = self.groups.loss_factor(state.iter, state.max_iters) as f64;
        let summed = self.summed.take();
        let peers = state.world_size() > 1;
        let grads = memory::in_phase(memory::phase::BACKWARD, || match &self.mixed {
            // fp32: the group's sums start the backward pass, no second set is made.
            None => grads::backward::<B, M>(loss.div_scalar(divisor), &state.model, summed),
            // Half: the forward copy's gradients are half and scaled, the sums fp32.
            Some(mixed) => {
                let scale = mixed.scaler.loss_scale();
                let loss = loss.cast(DType::F32).mul_scalar(scale / divisor);
                let grads = grads::backward::<B, M>(loss, state.forward_model(), None)?;
                Ok(match summed {
                    // Each half gradient is cast as it is added to its fp32 sum. With peers, one
                    // that no earlier micro-batch gave a sum (a branch they did not reach) is
                    // cast too, as another peer's sum of it is fp32 (one precision to average;
                    // training alone the step casts it, a part at a time).
                    Some(mut summed) => {
                        grads::accumulate::<B, M>(&state.model, &mut summed, grads);
                        if peers {
                            grads::to_f32::<B, M>(&state.model, &mut summed);
                        }
                        summed
                    }
                    // Half: cast at the step, group by group, or below as a group's first sums.
                    None => grads,
                })
            }
        })?;
        *self.pending += 1;
        Ok(Some(grads))
    }

    /// A micro-batch that does not end its group: backward, its gradients kept as the group's
    /// sums (fp32).
    pub(super) fn accumulate<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) -> Result<()>
    where
        R: Reducer<B>,
    {
        let Some(mut grads) = self.backward_into_sums(state)? else {
            return Ok(());
        };
        if self.mixed.is_some() {
            // The group's first sums, in fp32.
            memory::scope(memory::phase::BACKWARD, || {
                grads::to_f32::<B, M>(&state.model, &mut grads)
            });
        }
        *self.summed = Some(grads);
        if let Some(mixed) = &self.mixed {
            state.log.loss_scale = mixed.logged_scale();
        }
        Ok(())
    }
}

/// MMCV's `detect_anomalous_params` warning, naming the parameters `missing` (if any).
pub(super) fn warn_without_gradient<B: AutodiffBackend, M: TrainModel<B>>(
    state: &mut TrainState<B, M>,
    missing: Vec<String>,
) {
    if !missing.is_empty() {
        state.warn(format!(
            "iteration {}: these trainable parameters got no gradient (not used in the loss): {}",
            state.iter,
            missing.join(", ")
        ));
    }
}
