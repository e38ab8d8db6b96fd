//! The reduction part of the optimizer hook: what makes one peer's gradients, overflow and
//! logged values the run's. Training alone it does nothing ([`Alone`]); a data-parallel peer
//! averages over the others ([`crate::parallel::PeerReducer`]).

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use crate::train::IterLog;
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
