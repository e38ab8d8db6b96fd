//! Where and when the optimizer's step runs, a part of the optimizer hook beside precision,
//! grouping and reduction:
//!
//! - [`AfterBackward`]: after the group's last backward, on every gradient (MMCV's);
//! - [`InBackward`]: in backward, each parameter as its gradient is final, in one pass or two
//!   (`step_in_backward = true`);
//! - [`ShardedByOwner`]: after a backward that averages each gradient to the peer that owns it
//!   (ZeRO stage 2, on Burn's autodiff with peers);
//! - [`OnHost`]: in backward as [`InBackward`], each parameter stepped in host memory with the
//!   optimizer's state and fp32 master there (`[offload] optimizer = true`).
//!
//! ZeRO stage 1, and stage 2 elsewhere, are not places: they are the reduction part's
//! (`Reducer::keep_own`, `share_stepped`), whichever place steps. A new place is a new file and
//! a new variant of [`Place`], not a branch in the hook.

mod after_backward;
mod in_backward;
mod on_host;
mod sharded;

use burn::tensor::backend::AutodiffBackend;

pub(super) use after_backward::AfterBackward;
pub(super) use in_backward::InBackward;
pub(super) use on_host::OnHost;
pub(super) use sharded::ShardedByOwner;

use super::parts::Parts;
use super::Reducer;
use crate::train::{tapping, TrainModel, TrainState};
use crate::Result;

/// Taps every trainable parameter of the model the next forward runs on, for `phase` of the
/// step in backward (`log_norm`: the pass records the gradients' norm), with this peer's
/// reduction where the reducer has peers.
fn tap<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
    parts: &Parts<'_, R>,
    state: &mut TrainState<B, M>,
    phase: tapping::Phase,
    norm_type: f64,
    log_norm: bool,
) {
    let peers = parts.reducer.tap_peers(&state.model);
    let mut tapping = std::mem::take(&mut state.tapping);
    tapping.tap(state, phase, norm_type, log_norm, peers);
    state.tapping = tapping;
}

/// One place of the step: what it does at each of the hook's moments. A micro-batch that does
/// not end its group is the same everywhere ([`Parts::accumulate`]) but on the host, which keeps
/// the group's sums there.
// The places (in_backward.rs, on_host.rs) repeat the signatures of the methods they override,
// as Rust's trait impls must: those repeated lines share no logic to factor out.
pub(super) trait StepPlace {
    /// Before the run: what the place needs of the backend and the peers.
    fn before_run<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        _parts: &Parts<'_, R>,
        _state: &mut TrainState<B, M>,
    ) -> Result<()> {
        Ok(())
    }

    /// Before the forward of a group's last iteration (the taps go on here).
    fn before_last_iter<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        _parts: &Parts<'_, R>,
        _state: &mut TrainState<B, M>,
    ) -> Result<()> {
        Ok(())
    }

    /// Before the forward of an iteration that does not end its group.
    fn before_micro_batch<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        _parts: &Parts<'_, R>,
        _state: &mut TrainState<B, M>,
    ) -> Result<()> {
        Ok(())
    }

    /// After the forward of an iteration that does not end its group: backward, its gradients
    /// added to the group's sums.
    fn accumulate<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        parts.accumulate(state)
    }

    /// After the first of two forwards (see `TrainState::forward_passes`).
    fn after_first_pass<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        _parts: &mut Parts<'_, R>,
        _state: &mut TrainState<B, M>,
    ) -> Result<()> {
        Ok(())
    }

    /// The optimizer state the place holds instead of `TrainState::optimizer` (the step on the
    /// host's), as `Optim::to_bytes` writes it, for snapshots.
    fn held_state(&self) -> Option<Result<Vec<u8>>> {
        None
    }

    /// The trained model's record (as `record_bytes` writes it) where the place holds its
    /// weights elsewhere than `TrainState::model` (the fp32 masters on the host, under mixed
    /// precision with optimizer offload), for snapshots.
    fn held_model<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        _state: &TrainState<B, M>,
    ) -> Option<Result<Vec<u8>>> {
        None
    }

    /// After the run: `TrainState::model` holds the trained weights again where the place
    /// held them elsewhere.
    fn after_run<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        _state: &mut TrainState<B, M>,
    ) -> Result<()> {
        Ok(())
    }

    /// After the (last) forward of a group's last iteration: backward, then the step or its
    /// skip.
    fn end_group<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()>;
}

/// The place the hook's step takes in a run, chosen before it ([`Place::choose`]).
#[derive(Debug)]
pub(super) enum Place {
    /// See [`AfterBackward`].
    AfterBackward(AfterBackward),
    /// See [`InBackward`].
    InBackward(InBackward),
    /// See [`ShardedByOwner`].
    ShardedByOwner(ShardedByOwner),
    /// See [`OnHost`].
    OnHost(OnHost),
}

impl Default for Place {
    fn default() -> Self {
        Place::AfterBackward(AfterBackward)
    }
}

impl Place {
    /// The place for a run: on the host where optimizer offload is asked and the device has
    /// memory of its own; else in backward where asked (`step_in_backward`); else, where the
    /// reduction keeps each gradient with its owner only (ZeRO stage 2) and the backend can
    /// reduce in backward (Burn's autodiff, with peers), after a backward that does; else after
    /// backward.
    pub(super) fn choose<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        step_in_backward: bool,
        optimizer_offload: bool,
        reducer: &R,
        state: &TrainState<B, M>,
    ) -> Place {
        if optimizer_offload {
            use crate::checkpoint::offload::{nothing_to_save, staging, StagingSupport};
            if staging::<B::InnerBackend>() != StagingSupport::NothingToSave {
                return Place::OnHost(OnHost::default());
            }
            // Flex: the host is the device; the step runs where it would without offload.
            let notice = nothing_to_save::<B::InnerBackend>("offload.optimizer");
            tracing::info!(target: "memsave", key = "offload.optimizer", "{notice}");
        }
        if step_in_backward {
            Place::InBackward(InBackward::default())
        } else if reducer.reduces_to_owners() && state.world_size() > 1 && tapping::supported::<B>()
        {
            Place::ShardedByOwner(ShardedByOwner)
        } else {
            Place::AfterBackward(AfterBackward)
        }
    }
}

/// Each of [`StepPlace`]'s methods, called on the place in use.
macro_rules! dispatch {
    ($place:expr, $method:ident($($arg:expr),*)) => {
        match $place {
            Place::AfterBackward(place) => place.$method($($arg),*),
            Place::InBackward(place) => place.$method($($arg),*),
            Place::ShardedByOwner(place) => place.$method($($arg),*),
            Place::OnHost(place) => place.$method($($arg),*),
        }
    };
}

impl StepPlace for Place {
    fn held_state(&self) -> Option<Result<Vec<u8>>> {
        dispatch!(self, held_state())
    }

    fn held_model<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &TrainState<B, M>,
    ) -> Option<Result<Vec<u8>>> {
        dispatch!(self, held_model(state))
    }

    fn after_run<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        dispatch!(self, after_run(state))
    }

    fn before_run<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        dispatch!(self, before_run(parts, state))
    }

    fn before_last_iter<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        dispatch!(self, before_last_iter(parts, state))
    }

    fn before_micro_batch<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        dispatch!(self, before_micro_batch(parts, state))
    }

    fn accumulate<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        dispatch!(self, accumulate(parts, state))
    }

    fn after_first_pass<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        dispatch!(self, after_first_pass(parts, state))
    }

    fn end_group<B: AutodiffBackend, M: TrainModel<B>, R: Reducer<B>>(
        &mut self,
        parts: &mut Parts<'_, R>,
        state: &mut TrainState<B, M>,
    ) -> Result<()> {
        dispatch!(self, end_group(parts, state))
    }
}
