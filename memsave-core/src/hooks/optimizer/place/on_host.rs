//! The step on the host (optimizer offload, `[offload] optimizer = true`; DeepSpeed's
//! ZeRO-Offload): the optimizer's state and the fp32 masters live in host memory
//! ([`crate::train::optim::HostState`]); in backward, each gradient, as soon as it is final, is
//! copied to the host and freed on the device, its parameter stepped there, and the new value
//! copied up. It taps as [`InBackward`] does (one pass, or two under clipping or mixed
//! precision: the same norm pass and the same overflow skip) and differs only in where each
//! parameter steps. Under ZeRO each peer steps, and holds on its host, its own part.
//!
//! Under mixed precision the device keeps the fp32 masters of `TrainState::model` beside the
//! half copy the forward runs on (the runner, snapshots and evaluation read the model's
//! weights); the host's masters are the ones the steps read.

use burn::tensor::backend::AutodiffBackend;

use super::super::parts::Parts;
use super::super::Reducer;
use super::{InBackward, StepPlace};
use crate::train::optim::HostState;
use crate::train::{Optim, TrainModel, TrainState};
use crate::{Error, Result};

/// The step on the host.
#[derive(Default)]
pub(in super::super) struct OnHost {
    /// The taps, passes and norm: the step in backward's.
    in_backward: InBackward,
    /// The state on the host (made before the run).
    host: Option<HostState>,
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
                .map_err(|error| Error::invalid("optimizer state", error.to_string()))
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
            .map_err(|error| Error::invalid("optimizer state", error.to_string()))?;
        host.load_bytes(&resumed).map_err(|error| {
            Error::invalid(
                "optimizer state",
                format!("could not be moved to the host: {error}"),
            )
        })?;
        state.optimizer = Optim::new(&spec);
        self.host = Some(host);
        Ok(())
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
        self.in_backward.after_first_pass(parts, state)
    }

    fn end_group<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        let host = self
            .host
            .as_mut()
            .expect("the state moved to the host before the run");
        self.in_backward.step_pass(parts, state, Some(host))
    }
}
