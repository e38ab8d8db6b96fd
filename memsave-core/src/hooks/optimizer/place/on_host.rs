//! The step on the host (optimizer offload, `[offload] optimizer = true`; DeepSpeed's
//! ZeRO-Offload): the optimizer's state and the fp32 masters live in host memory
//! ([`crate::train::optim::HostState`]); in backward, each gradient, as soon as it is final, is
//! copied to the host and freed on the device, its parameter stepped there, and the new value
//! copied up. It taps as [`InBackward`] does (one pass, or two under clipping or mixed
//! precision: the same norm pass and the same overflow skip) and differs only in where each
//! parameter steps. Under ZeRO each peer steps, and holds on its host, its own part.
//!
//! Under accumulation, training alone, the group's sums are on the host too: each micro-batch
//! that does not end its group is tapped, and each gradient, as soon as it is final, is copied
//! down and added to its fp32 sum there (ZeRO-Offload's), so the device never holds a whole set
//! of gradients; the group's last micro-batch adds its own to the sums on the host, where the
//! norm (clipping, the overflow check) and the step read them. With peers, the sums stay on the
//! device, where each gradient's average over the peers is made.
//!
//! Under mixed precision, training alone, the device keeps no fp32 weight: before the run the
//! trainable fp32 weights move to the host as the masters and `TrainState::model` becomes the
//! half copy the forward runs on, stepped in place (each new value crosses the link in half);
//! snapshots save the masters, evaluation during the run reads the half model (MMCV's
//! `Fp16OptimizerHook` evaluates its half model too), and after the run the model is fp32
//! again, from the masters. With peers (each stepping only its part) the device keeps the fp32
//! model beside the half copy.

use burn::tensor::backend::AutodiffBackend;

use super::super::parts::Parts;
use super::super::Reducer;
use super::{InBackward, StepPlace};
use crate::train::optim::HostState;
use crate::train::tapping::Phase;
use crate::train::{Optim, TrainModel, TrainState};
use crate::{Error, Result};

const MOVED: &str = "the state moved to the host before the run";

/// The step on the host.
#[derive(Default)]
pub(in super::super) struct OnHost {
    /// The taps, passes and norm: the step in backward's.
    in_backward: InBackward,
    /// The state on the host (made before the run).
    host: Option<HostState>,
    /// Whether the group's sums are kept on the host (training alone).
    sums_on_host: bool,
}

impl std::fmt::Debug for OnHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnHost")
            .field("in_backward", &self.in_backward)
            .finish_non_exhaustive()
    }
}

impl StepPlace for OnHost {
    fn held_state(&self) -> Option<Result<Vec<u8>>> {
        self.host.as_ref().map(|host| {
            host.to_bytes()
                .map_err(|error| Error::state("optimizer state", error))
        })
    }

    fn before_run<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        self.in_backward.before_run(parts, state)?;
        crate::checkpoint::offload::can_offload::<B::InnerBackend>()
            .map_err(|why| Error::invalid("offload.optimizer", why))?;
        let spec = state.optimizer_spec.clone().ok_or_else(|| {
            Error::invalid(
                "offload.optimizer",
                "needs the optimizer's settings to build its state on the host: train with \
                 memsave's `Runner`, which keeps them",
            )
        })?;
        // A resumed state (loaded on the device) moves to the host, this peer's part only under
        // ZeRO; the device keeps none.
        parts.reducer.own_state(&state.model, &mut state.optimizer);
        let mut host = HostState::new(&spec);
        let resumed = state
            .optimizer
            .to_bytes()
            .map_err(|error| Error::state("optimizer state", error))?;
        host.load_bytes(&resumed)
            .map_err(|error| Error::state("optimizer state, moved to the host", error))?;
        state.optimizer = Optim::new(&spec);
        self.sums_on_host = state.world_size() == 1;
        // Mixed precision: the fp32 weights to the host, the half copy the model on the device.
        // 16-bit weights are their only copy, on the device: the host keeps no master.
        if self.sums_on_host && state.masters_on_host.is_none() && state.weights.is_none() {
            if let Some(half) = state.forward_model.take() {
                let fp32 = std::mem::replace(&mut state.model, half);
                state.masters_on_host = Some(host.take_masters(fp32));
            }
        }
        self.host = Some(host);
        Ok(())
    }

    fn held_model<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &TrainState<B, M>,
    ) -> Option<Result<Vec<u8>>> {
        let skeleton = state.masters_on_host.clone()?;
        let model = self.host.as_ref().expect(MOVED).with_masters(skeleton);
        // Frozen weights held compressed: their dequantized values.
        let model = crate::nn::frozen::expand(model, &crate::nn::frozen::frozen_weights());
        Some(
            crate::train::snapshot::codec::record_bytes::<B, _>(model.into_record())
                .map_err(|error| Error::state("model", error)),
        )
    }

    /// The fp32 model again, from the masters, the half copy beside it as without offload.
    fn after_run<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        if let (Some(skeleton), Some(host)) = (state.masters_on_host.take(), &self.host) {
            let fp32 = host.with_masters(skeleton);
            state.forward_model = Some(std::mem::replace(&mut state.model, fp32));
        }
        Ok(())
    }

    fn before_micro_batch<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        if self.sums_on_host {
            super::tap(parts, state, Phase::Accumulate, parts.norm_type(), false);
        }
        Ok(())
    }

    /// A micro-batch that does not end its group: backward, each gradient added to its sum on
    /// the host as soon as it is final.
    fn accumulate<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        if !self.sums_on_host {
            return self.in_backward.accumulate_pass(parts, state, None);
        }
        let host = self.host.as_mut().expect(MOVED);
        let mut sums = host.take_sums();
        let outcome = self
            .in_backward
            .accumulate_pass(parts, state, Some(&mut sums));
        host.put_back_sums(sums);
        outcome
    }

    fn before_last_iter<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        self.in_backward.before_last_iter(parts, state)
    }

    fn after_first_pass<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        let host = self.host.as_mut().expect(MOVED);
        let mut sums = host.take_sums();
        let outcome =
            self.in_backward
                .norm_pass(parts, state, self.sums_on_host.then_some(&mut sums));
        host.put_back_sums(sums);
        outcome
    }

    fn end_group<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        let host = self.host.as_mut().expect(MOVED);
        self.in_backward.step_pass(parts, state, Some(host))
    }
}
