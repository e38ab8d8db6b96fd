//! What makes a runner one peer of a data-parallel run, as parts of the runner's own kinds (the
//! loop has no branch for it): the optimizer hook's reduction part ([`PeerReducer`]), the
//! weight broadcast before the run ([`BroadcastHook`]), and the peer's place in the state,
//! which the snapshot and logger hooks read to leave saving and logging to rank 0
//! ([`attach`]).

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use super::{agree_any, all_reduce_grads, broadcast_module, mean_for_log, SharedCollective};
use crate::hooks::Reducer;
use crate::train::{
    DataSource, Hook, IterLog, PeerPlace, Priority, Runner, TrainModel, TrainState,
};
use crate::Result;

/// The optimizer hook's reduction over the peers of `collective`
/// ([`crate::hooks::OptimizerHook::with_reducer`]): gradients averaged once per optimizer step
/// in buckets ([`all_reduce_grads`]), an overflow on any peer skips the step on all, the log
/// shows the mean loss.
pub struct PeerReducer<B: burn::prelude::Backend> {
    collective: SharedCollective<B>,
    device: B::Device,
}

impl<B: burn::prelude::Backend> PeerReducer<B> {
    /// The reducer of this peer, whose tensors live on `device`.
    pub fn new(collective: SharedCollective<B>, device: &B::Device) -> Self {
        PeerReducer {
            collective,
            device: device.clone(),
        }
    }
}

impl<B: burn::prelude::Backend> std::fmt::Debug for PeerReducer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PeerReducer(rank {} of {})",
            self.collective.rank(),
            self.collective.world_size()
        )
    }
}

impl<A: AutodiffBackend> Reducer<A> for PeerReducer<A::InnerBackend> {
    fn mean_grads<M: AutodiffModule<A>>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<()> {
        all_reduce_grads::<A, M>(&*self.collective, model, grads, &self.device)
    }

    fn any(&self, flag: bool) -> Result<bool> {
        agree_any(&*self.collective, flag, &self.device)
    }

    fn mean_for_log(&self, log: &mut IterLog) -> Result<()> {
        let mut values: Vec<f64> = std::iter::once(log.loss.unwrap_or(0.0))
            .chain(log.parts.iter().map(|(_, value)| *value))
            .collect();
        mean_for_log(&*self.collective, &mut values, &self.device)?;
        log.loss = values.first().copied();
        for ((_, part), value) in log.parts.iter_mut().zip(&values[1..]) {
            *part = *value;
        }
        Ok(())
    }
}

/// Before the first iteration (after a resume too), every peer takes rank 0's weights
/// ([`broadcast_module`]). Runs at [`Priority::VeryHigh`], before the optimizer hook makes its
/// half copy of them.
pub struct BroadcastHook<B: burn::prelude::Backend> {
    collective: SharedCollective<B>,
}

impl<B: burn::prelude::Backend> BroadcastHook<B> {
    /// Broadcasts over `collective`.
    pub fn new(collective: SharedCollective<B>) -> Self {
        BroadcastHook { collective }
    }
}

impl<A: AutodiffBackend, M: TrainModel<A>> Hook<A, M> for BroadcastHook<A::InnerBackend> {
    fn name(&self) -> &'static str {
        "broadcast"
    }

    fn before_run(&mut self, state: &mut TrainState<A, M>) -> Result<()> {
        state.model = broadcast_module::<A, M>(&*self.collective, state.model.clone())?;
        Ok(())
    }
}

/// Makes `runner` the peer of `collective` in a data-parallel run: its state learns its rank
/// (rank 0 alone logs and writes snapshots; warnings print there only) and it starts from
/// rank 0's weights ([`BroadcastHook`]). Its optimizer hook must average over the same peers
/// (`OptimizerHook::with_reducer(PeerReducer::new(..))`), and its data source read this
/// peer's shard ([`super::Collective::shard`]).
pub fn attach<A, M, D>(runner: &mut Runner<A, M, D>, collective: SharedCollective<A::InnerBackend>)
where
    A: AutodiffBackend,
    M: TrainModel<A>,
    D: DataSource<A, M::Batch>,
{
    runner.state_mut().peer = PeerPlace {
        rank: collective.rank(),
        world_size: collective.world_size(),
    };
    runner.register_hook_at(Box::new(BroadcastHook::new(collective)), Priority::VeryHigh);
}
