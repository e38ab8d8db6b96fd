//! The reduction part of the optimizer hook: what makes one peer's gradients, overflow and
//! logged values the run's. Training alone it does nothing ([`Alone`]); a data-parallel peer
//! averages over the others ([`crate::parallel::PeerReducer`]).

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use crate::parallel::{TapPeers, ZeroStage};
use crate::train::{grads, IterLog, Optim};
use crate::Result;

/// How the optimizer hook combines what each peer computed. Every peer makes the same calls in
/// the same order.
pub trait Reducer<B: AutodiffBackend> {
    /// `grads` (of `model`'s parameters) become their mean over the peers, the same bits on
    /// every peer; called once per optimizer step, before anything reads them.
    fn mean_grads<M: AutodiffModule<B>>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<()>;

    /// Whether `flag` (an overflow) holds on any peer.
    fn any(&self, flag: bool) -> Result<bool>;

    /// The iteration's logged loss and its parts become their means over the peers.
    fn mean_for_log(&self, log: &mut IterLog) -> Result<()>;

    /// What is sharded across the peers: the optimizer hook drops the gradients another peer
    /// steps ([`Reducer::keep_own`]) as soon as they are averaged at stage 2, after the norm
    /// at stage 1.
    fn zero_stage(&self) -> ZeroStage {
        ZeroStage::Off
    }

    /// The global `norm_type`-norm of the gradients of every peer's part: where each peer
    /// holds only its part (ZeRO stage 2), the others' are gathered. Alone, or holding them
    /// all: [`grads::global_norm`].
    fn global_norm<M: AutodiffModule<B>>(
        &self,
        model: &M,
        grads: &GradientsParams,
        norm_type: f64,
    ) -> Result<Option<f64>> {
        Ok(grads::global_norm::<B, M>(model, grads, norm_type))
    }

    /// Drops the gradients of the parameters another peer steps (ZeRO); all are kept alone.
    fn keep_own<M: AutodiffModule<B>>(&self, _model: &M, _grads: &mut GradientsParams) {}

    /// Drops, before the norm is taken, the gradients of the parameters another peer steps,
    /// where the norm is gathered from their owners (ZeRO stage 2); nothing otherwise.
    fn keep_own_before_norm<M: AutodiffModule<B>>(&self, _model: &M, _grads: &mut GradientsParams) {
    }

    /// Whether each peer steps and keeps the optimizer state of its part only (ZeRO stages 1
    /// and 2): the new values are then shared after each step ([`Reducer::share_stepped`]).
    fn shards(&self) -> bool {
        false
    }

    /// Whether each gradient is kept by the peer that steps its parameter only (ZeRO stage 2):
    /// on Burn's autodiff, the group's last backward then averages each one to its owner as it
    /// is made.
    fn reduces_to_owners(&self) -> bool {
        false
    }

    /// The shares of the gradients and of the optimizer state this peer holds, of `world`
    /// peers (the memory check before the run: ZeRO holds 1/world of them).
    fn held_shares(&self, _world: usize) -> (f64, f64) {
        (1.0, 1.0)
    }

    /// After a step: every parameter's new value from the peer that stepped it, on every peer
    /// (ZeRO); as it is alone.
    fn share_stepped<M: AutodiffModule<B>>(&self, _model: &mut M) -> Result<()> {
        Ok(())
    }

    /// Drops the optimizer state of the parameters another peer steps (ZeRO, after a resume
    /// from a whole state).
    fn own_state<M: AutodiffModule<B>>(&self, _model: &M, _optimizer: &mut Optim<B, M>) {}

    /// The peers a backward pass averages each gradient over as its tap hands it over, and the
    /// parameters this peer keeps (the step in backward, and ZeRO stage 2's reduction to the
    /// owners); `None` alone.
    fn tap_peers<M: AutodiffModule<B>>(&self, _model: &M) -> Option<TapPeers<B::InnerBackend>> {
        None
    }

    /// The whole optimizer state as [`Optim::to_bytes`] writes it, gathered from every peer's
    /// part and keyed by this peer's parameter ids, for a snapshot (every peer calls it); `None`
    /// where each peer holds it whole. This peer's part is `optimizer`'s, or `held` where the
    /// step's place holds it instead (on the host).
    fn whole_state<M: AutodiffModule<B>>(
        &self,
        _model: &M,
        _optimizer: &Optim<B, M>,
        _held: Option<&[u8]>,
    ) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    /// Every peer's bytes `mine`, in rank order, where each peer holds a part of the state
    /// (ZeRO: the 16-bit weights' Kahan compensations, each peer's for its own parameters), for
    /// a snapshot (every peer calls it); `None` where each peer holds it whole.
    fn gather_parts(&self, _mine: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        Ok(None)
    }
}

/// Training alone: nothing to combine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Alone;

impl<B: AutodiffBackend> Reducer<B> for Alone {
    fn mean_grads<M: AutodiffModule<B>>(&self, _: &M, _: &mut GradientsParams) -> Result<()> {
        Ok(())
    }

    fn any(&self, flag: bool) -> Result<bool> {
        Ok(flag)
    }

    fn mean_for_log(&self, _: &mut IterLog) -> Result<()> {
        Ok(())
    }
}
