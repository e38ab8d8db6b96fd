//! What makes a runner one peer of a data-parallel run, as parts of the runner's own kinds (the
//! loop has no branch for it): the optimizer hook's reduction part ([`PeerReducer`]), the
//! weight broadcast before the run ([`BroadcastHook`]), and the peer's place in the state,
//! which the snapshot and logger hooks read to leave saving and logging to rank 0
//! ([`attach`]).

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use super::zero::{self, ZeroStage};
use super::{
    agree_any, all_reduce_grads, broadcast_module, mean_for_log, SharedCollective, TapPeers,
};
use crate::hooks::Reducer;
use crate::train::{
    DataSource, Hook, IterLog, Optim, PeerPlace, Priority, Runner, TrainModel, TrainState,
};
use crate::Result;

/// The optimizer hook's reduction over the peers of `collective`
/// ([`crate::hooks::OptimizerHook::with_reducer`]): gradients averaged once per optimizer step
/// in buckets ([`all_reduce_grads`]), an overflow on any peer skips the step on all, the log
/// shows the mean loss. With a [`ZeroStage`], each peer steps only its part of the parameters
/// (see [`super::zero`]).
pub struct PeerReducer<B: burn::prelude::Backend> {
    collective: SharedCollective<B>,
    device: B::Device,
    zero: ZeroStage,
}

impl<B: burn::prelude::Backend> PeerReducer<B> {
    /// The reducer of this peer, whose tensors live on `device`.
    pub fn new(collective: SharedCollective<B>, device: &B::Device) -> Self {
        PeerReducer {
            collective,
            device: device.clone(),
            zero: ZeroStage::Off,
        }
    }

    /// The same reducer sharding the optimizer state (stage 1), and the gradients (stage 2),
    /// across the peers (ZeRO).
    pub fn with_zero_stage(mut self, stage: ZeroStage) -> Self {
        self.zero = stage;
        self
    }

    /// What is sharded.
    pub fn zero_stage(&self) -> ZeroStage {
        self.zero
    }

    fn owned<A, M>(&self, model: &M) -> std::collections::HashSet<burn::module::ParamId>
    where
        A: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<A>,
    {
        zero::owned::<A, M>(model, self.collective.rank(), self.collective.world_size())
    }
}

impl<B: burn::prelude::Backend> std::fmt::Debug for PeerReducer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PeerReducer(rank {} of {}, ZeRO stage {})",
            self.collective.rank(),
            self.collective.world_size(),
            self.zero.number()
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

    fn zero_stage(&self) -> ZeroStage {
        self.zero
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

    fn global_norm<M: AutodiffModule<A>>(
        &self,
        model: &M,
        grads: &GradientsParams,
        norm_type: f64,
    ) -> Result<Option<f64>> {
        if self.zero >= ZeroStage::Gradients {
            zero::sharded_norm::<A, M>(&*self.collective, model, grads, norm_type, &self.device)
        } else {
            Ok(crate::train::grads::global_norm::<A, M>(
                model, grads, norm_type,
            ))
        }
    }

    fn keep_own<M: AutodiffModule<A>>(&self, model: &M, grads: &mut GradientsParams) {
        if self.zero > ZeroStage::Off {
            zero::keep_owned::<A, M>(model, grads, &self.owned::<A, M>(model));
        }
    }

    fn keep_own_before_norm<M: AutodiffModule<A>>(&self, model: &M, grads: &mut GradientsParams) {
        if self.zero >= ZeroStage::Gradients {
            self.keep_own(model, grads);
        }
    }

    fn shards(&self) -> bool {
        self.zero > ZeroStage::Off
    }

    fn reduces_to_owners(&self) -> bool {
        self.zero >= ZeroStage::Gradients
    }

    fn held_shares(&self, world: usize) -> (f64, f64) {
        let share = 1.0 / world.max(1) as f64;
        match self.zero {
            ZeroStage::Off => (1.0, 1.0),
            ZeroStage::OptimizerState => (1.0, share),
            ZeroStage::Gradients => (share, share),
        }
    }

    fn share_stepped<M: AutodiffModule<A>>(&self, model: &mut M) -> Result<()> {
        if self.zero == ZeroStage::Off {
            return Ok(());
        }
        let owned = self.owned::<A, M>(model);
        zero::share_stepped::<A, M>(&*self.collective, model, &owned)
    }

    fn tap_peers<M: AutodiffModule<A>>(&self, model: &M) -> Option<TapPeers<A::InnerBackend>> {
        let owned = (self.zero > ZeroStage::Off).then(|| self.owned::<A, M>(model));
        Some(TapPeers::new(self.collective.clone(), owned))
    }

    fn own_state<M: AutodiffModule<A>>(&self, model: &M, optimizer: &mut Optim<A, M>) {
        if self.zero > ZeroStage::Off {
            optimizer.retain(&self.owned::<A, M>(model));
        }
    }

    fn gather_parts(&self, mine: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        if self.zero == ZeroStage::Off {
            return Ok(None);
        }
        zero::gather_bytes(&*self.collective, mine, &self.device).map(Some)
    }

    fn whole_state<M: AutodiffModule<A>>(
        &self,
        model: &M,
        optimizer: &Optim<A, M>,
        held: Option<&[u8]>,
    ) -> Result<Option<Vec<u8>>> {
        use crate::train::snapshot::codec::{merge_by_param, rename_by_param};
        if self.zero == ZeroStage::Off {
            return Ok(None);
        }
        let bad = |error: crate::train::snapshot::codec::CodecError| {
            crate::Error::state("optimizer state", error)
        };
        // Each peer's parameters have their own ids: the parts travel keyed by position.
        let positions = zero::positions::<A, M>(model);
        let ids: std::collections::HashMap<u64, burn::module::ParamId> = positions
            .iter()
            .map(|(id, position)| (*position, *id))
            .collect();
        let mine = match held {
            Some(held) => held.to_vec(),
            None => optimizer.to_bytes().map_err(bad)?,
        };
        let mine =
            rename_by_param(&mine, |id| positions.get(&id).map(|&p| p.into())).map_err(bad)?;
        let parts = zero::gather_bytes(&*self.collective, &mine, &self.device)?;
        let whole = merge_by_param(&parts).map_err(bad)?;
        rename_by_param(&whole, |position| ids.get(&position.val()).copied())
            .map(Some)
            .map_err(bad)
    }
}

/// Before the first iteration (after a resume too), every peer takes rank 0's weights
/// (`broadcast_module`). Runs at `Priority::VeryHigh`, before the optimizer hook makes its
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
    let local = collective.local_ranks();
    runner.state_mut().peer = PeerPlace {
        rank: collective.rank(),
        world_size: collective.world_size(),
        local_first: local.start,
        local_peers: local.len(),
    };
    runner.register_hook_at(Box::new(BroadcastHook::new(collective)), Priority::VeryHigh);
}
