//! Helpers of the data-parallel tests (tests/suite/distributed.rs, tests/suite/zero.rs): peers as threads
//! of this process on Flex, the tiny classifier, traces of every step.
//!
//! burn-collective keeps one server per backend in a process: the tests take turns ([`turn`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use memsave::hooks::{GradClip, LrSchedule, LrUpdaterHook, OptimizerHook};
use memsave::models::classifier::ClassificationBatch;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::parallel::{
    run_local, BurnPeer, Collective, PeerReducer, Reduce, Shard, SharedCollective, Topology,
    ZeroStage,
};
use memsave::train::{
    DataSource, Hook, IterLog, OptimizerKind, OptimizerSpec, RunLength, Runner, TrainModel,
    TrainState,
};

use super::tiny::TinyNet;
use super::AB;

pub type Net = TinyNet<AB>;
pub type Data = SyntheticClassification<AB>;

/// One run of peers at a time (burn-collective's server is per process).
pub static TURN: Mutex<()> = Mutex::new(());

pub fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn data(batch: usize, samples: usize, shard: Shard) -> Data {
    let mut config = SyntheticClassificationConfig::new(batch, samples, 8);
    config.seed = 3;
    config.noise = 1.0;
    config.signal = 0.5;
    SyntheticClassification::new(config, 4, Default::default())
        .unwrap()
        .with_shard(shard)
}

/// The same start everywhere (no BatchNorm: statistics are per peer).
pub fn net() -> Net {
    TinyNet::new(4, false, &Default::default()).map(&mut super::tiny::Seeded(7))
}

pub fn work_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-dist-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub fn clip() -> Option<GradClip> {
    Some(GradClip::new(0.5, 2.0).unwrap())
}

pub fn runner<D: DataSource<AB, ClassificationBatch<AB>>>(
    model: Net,
    hook: Box<dyn Hook<AB, Net>>,
    data: D,
    length: RunLength,
    dir: &Path,
) -> Runner<AB, Net, D> {
    runner_with(model, &sgd(), hook, data, length, dir)
}

/// SGD with momentum 0.9 and weight decay 1e-4 (the plain runs' optimizer).
pub fn sgd() -> OptimizerKind {
    OptimizerKind::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
        nesterov: false,
    }
}

/// [`runner`] with `optimizer` (any model).
pub fn runner_with<M: TrainModel<AB>, D: DataSource<AB, M::Batch>>(
    model: M,
    optimizer: impl Into<OptimizerSpec>,
    hook: Box<dyn Hook<AB, M>>,
    data: D,
    length: RunLength,
    dir: &Path,
) -> Runner<AB, M, D> {
    let mut runner = Runner::new(
        model,
        optimizer,
        hook,
        data,
        length,
        dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.05),
    }));
    runner
}

/// A runner that is one peer of `collective`: its optimizer hook averages over the peers and
/// it starts from rank 0's weights.
pub fn peer_runner<D: DataSource<AB, ClassificationBatch<AB>>>(
    model: Net,
    hook: OptimizerHook,
    data: D,
    length: RunLength,
    dir: &Path,
    collective: SharedCollective<Flex>,
) -> Runner<AB, Net, D> {
    peer_runner_with(
        model,
        &sgd(),
        ZeroStage::Off,
        hook,
        data,
        length,
        dir,
        collective,
    )
}

/// [`peer_runner`] with `optimizer`, sharding at ZeRO `stage` (any model).
#[allow(clippy::too_many_arguments)]
pub fn peer_runner_with<M: TrainModel<AB>, D: DataSource<AB, M::Batch>>(
    model: M,
    optimizer: impl Into<OptimizerSpec>,
    stage: ZeroStage,
    hook: OptimizerHook,
    data: D,
    length: RunLength,
    dir: &Path,
    collective: SharedCollective<Flex>,
) -> Runner<AB, M, D> {
    let reducer = PeerReducer::new(collective.clone(), &Default::default()).with_zero_stage(stage);
    let mut runner = runner_with(
        model,
        optimizer,
        Box::new(hook.with_reducer(reducer)),
        data,
        length,
        dir,
    );
    memsave::parallel::attach(&mut runner, collective);
    runner
}

pub fn weights<M: Module<AB>>(model: &M) -> Vec<f32> {
    struct All(Vec<f32>);
    impl ModuleVisitor<AB> for All {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.0.extend(super::values(param.val().inner()));
        }
    }
    let mut all = All(Vec::new());
    model.visit(&mut all);
    all.0
}

/// After every iteration: the weights and the log.
#[derive(Clone, Default)]
pub struct Trace(pub Arc<Mutex<Vec<(Vec<f32>, IterLog)>>>);

impl<M: TrainModel<AB>> Hook<AB, M> for Trace {
    fn name(&self) -> &'static str {
        "trace"
    }

    fn after_iter(&mut self, state: &mut TrainState<AB, M>) -> memsave::Result<()> {
        let entry = (weights(&state.model), state.log.clone());
        self.0.lock().unwrap().push(entry);
        Ok(())
    }
}

impl Trace {
    pub fn take(&self) -> Vec<(Vec<f32>, IterLog)> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

/// Runs `n` peers of this process on Flex.
pub fn peers<T: Send>(
    n: usize,
    body: impl Fn(Arc<BurnPeer<Flex>>) -> memsave::Result<T> + Sync,
) -> memsave::Result<Vec<T>> {
    run_local::<Flex, T, _>(&Topology::local(n), vec![Default::default(); n], body)
}

/// Final weights and per-step trace of each of 2 peers, each running `hook()` at batch `batch`.
pub fn two_peers(
    name: &str,
    hook: impl Fn() -> OptimizerHook + Sync,
    batch: usize,
    samples: usize,
    length: RunLength,
) -> Vec<(Vec<f32>, Vec<(Vec<f32>, IterLog)>)> {
    two_peers_with(name, &sgd(), ZeroStage::Off, hook, batch, samples, length)
        .into_iter()
        .map(|(weights, trace, _)| (weights, trace))
        .collect()
}

/// [`two_peers`] with `optimizer` at ZeRO `stage`; each peer's run also gives the number of
/// parameters its optimizer keeps state for.
pub fn two_peers_with(
    name: &str,
    optimizer: &OptimizerKind,
    stage: ZeroStage,
    hook: impl Fn() -> OptimizerHook + Sync,
    batch: usize,
    samples: usize,
    length: RunLength,
) -> Vec<(Vec<f32>, Vec<(Vec<f32>, IterLog)>, u64)> {
    two_peers_of(
        name,
        net,
        |_, shard| data(batch, samples, shard),
        optimizer,
        stage,
        hook,
        length,
    )
}

/// [`two_peers_with`] with any model (`model()` on each peer) and data (`data(rank, shard)`).
pub fn two_peers_of<M: TrainModel<AB>, D: DataSource<AB, M::Batch>>(
    name: &str,
    model: impl Fn() -> M + Sync,
    data: impl Fn(usize, Shard) -> D + Sync,
    optimizer: impl Into<OptimizerSpec> + Copy + Sync,
    stage: ZeroStage,
    hook: impl Fn() -> OptimizerHook + Sync,
    length: RunLength,
) -> Vec<(Vec<f32>, Vec<(Vec<f32>, IterLog)>, u64)> {
    let dir = work_dir(name);
    peers(2, |peer| {
        let shard = peer.shard();
        let mut runner = peer_runner_with(
            model(),
            optimizer,
            stage,
            hook(),
            data(peer.rank(), shard),
            length,
            &dir,
            peer,
        );
        let trace = Trace::default();
        runner.register_hook(Box::new(trace.clone()));
        runner.run()?;
        let state = runner.state().optimizer.to_bytes().unwrap();
        // The number of entries comes first.
        let entries = u64::from_le_bytes(state[..8].try_into().unwrap());
        Ok((weights(&runner.into_model()), trace.take(), entries))
    })
    .unwrap()
}

/// The final weights of one process at batch `batch`.
pub fn alone(
    name: &str,
    hook: OptimizerHook,
    batch: usize,
    samples: usize,
    length: RunLength,
) -> Vec<f32> {
    let dir = work_dir(name);
    let mut runner = runner(
        net(),
        Box::new(hook),
        data(batch, samples, Shard::whole()),
        length,
        &dir,
    );
    runner.run().unwrap();
    weights(&runner.into_model())
}

pub fn assert_close(a: &[f32], b: &[f32], tolerance: f32) -> f32 {
    let difference = super::max_relative_difference(a, b);
    assert!(
        difference <= tolerance,
        "relative difference {difference} > {tolerance}"
    );
    difference
}

/// Peers hold the same bits after every iteration.
pub fn assert_identical_peers(runs: &[(Vec<f32>, Vec<(Vec<f32>, IterLog)>)]) {
    let (first, rest) = runs.split_first().unwrap();
    for other in rest {
        assert_eq!(first.1.len(), other.1.len());
        for (step, (a, b)) in first.1.iter().zip(&other.1).enumerate() {
            assert!(
                a.0 == b.0,
                "the peers' weights differ after iteration {step}"
            );
            assert_eq!(a.1.loss, b.1.loss, "the logged loss is the peers' mean");
            assert_eq!(a.1.grad_norm, b.1.grad_norm);
            assert_eq!(a.1.loss_scale, b.1.loss_scale);
        }
        assert!(first.0 == other.0);
    }
}

/// A peer that counts the elements it all-reduces.
pub struct Counting {
    pub inner: Arc<BurnPeer<Flex>>,
    pub elements: AtomicUsize,
}

impl Collective<Flex> for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(
        &self,
        tensor: FloatTensor<Flex>,
        op: Reduce,
    ) -> memsave::Result<FloatTensor<Flex>> {
        self.elements
            .fetch_add(tensor.shape().num_elements(), Ordering::SeqCst);
        self.inner.all_reduce(tensor, op)
    }
}

/// Records the elements all-reduced during each iteration.
pub struct PerIteration {
    pub counting: Arc<Counting>,
    pub seen: usize,
    pub out: Option<Arc<Mutex<Vec<usize>>>>,
}

impl Hook<AB, Net> for PerIteration {
    fn name(&self) -> &'static str {
        "per-iteration"
    }

    fn before_iter(&mut self, _state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        self.seen = self.counting.elements.load(Ordering::SeqCst);
        Ok(())
    }

    fn after_iter(&mut self, _state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        let now = self.counting.elements.load(Ordering::SeqCst);
        if let Some(out) = &self.out {
            out.lock().unwrap().push(now - self.seen);
        }
        Ok(())
    }
}
