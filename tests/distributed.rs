//! Data parallelism on burn-collective (REFERENCE.md section 6), peers as threads of this process
//! on Flex: 2 peers x batch b train like one process at batch 2b (plain, with accumulation, in
//! fp16), peers hold the same bits after every step, an overflow on one peer skips the step on
//! all, a peer that fails ends the run on every peer with an error naming it.
//!
//! burn-collective keeps one server per backend in a process: the tests take turns.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use common::tiny::TinyNet;
use common::{watchdog, AB};
use memsave::hooks::{
    Fp16OptimizerHook, GradClip, GradientCumulativeOptimizerHook, LrSchedule, LrUpdaterHook,
    OptimizerHook,
};
use memsave::models::classifier::ClassificationBatch;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::parallel::{
    run_local, BurnPeer, Collective, PeerReducer, Reduce, Shard, SharedCollective, Topology,
};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{DataSource, Hook, IterLog, OptimizerKind, RunLength, Runner, TrainState};

type Net = TinyNet<AB>;
type Data = SyntheticClassification<AB>;

/// One run of peers at a time (burn-collective's server is per process).
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn data(batch: usize, samples: usize, shard: Shard) -> Data {
    let mut config = SyntheticClassificationConfig::new(batch, samples, 8);
    config.seed = 3;
    config.noise = 1.0;
    config.signal = 0.5;
    SyntheticClassification::new(config, 4, Default::default())
        .unwrap()
        .with_shard(shard)
}

/// The same start everywhere (no BatchNorm: statistics are per peer).
fn net() -> Net {
    TinyNet::new(4, false, &Default::default()).map(&mut common::tiny::Seeded(7))
}

fn work_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-dist-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn clip() -> Option<GradClip> {
    Some(GradClip::new(0.5, 2.0).unwrap())
}

fn runner<D: DataSource<AB, ClassificationBatch<AB>>>(
    model: Net,
    hook: Box<dyn Hook<AB, Net>>,
    data: D,
    length: RunLength,
    dir: &Path,
) -> Runner<AB, Net, D> {
    let sgd = OptimizerKind::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
        nesterov: false,
    };
    let mut runner = Runner::new(model, &sgd, hook, data, length, dir, Default::default()).unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.05),
    }));
    runner
}

/// A runner that is one peer of `collective`: its optimizer hook averages over the peers and
/// it starts from rank 0's weights.
fn peer_runner<D: DataSource<AB, ClassificationBatch<AB>>>(
    model: Net,
    hook: OptimizerHook,
    data: D,
    length: RunLength,
    dir: &Path,
    collective: SharedCollective<Flex>,
) -> Runner<AB, Net, D> {
    let reducer = PeerReducer::new(collective.clone(), &Default::default());
    let mut runner = runner(
        model,
        Box::new(hook.with_reducer(reducer)),
        data,
        length,
        dir,
    );
    memsave::parallel::attach(&mut runner, collective);
    runner
}

fn weights(model: &Net) -> Vec<f32> {
    struct All(Vec<f32>);
    impl ModuleVisitor<AB> for All {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.0.extend(common::values(param.val().inner()));
        }
    }
    let mut all = All(Vec::new());
    model.visit(&mut all);
    all.0
}

/// After every iteration: the weights and the log.
#[derive(Clone, Default)]
struct Trace(Arc<Mutex<Vec<(Vec<f32>, IterLog)>>>);

impl Hook<AB, Net> for Trace {
    fn name(&self) -> &'static str {
        "trace"
    }

    fn after_iter(&mut self, state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        let entry = (weights(&state.model), state.log.clone());
        self.0.lock().unwrap().push(entry);
        Ok(())
    }
}

impl Trace {
    fn take(&self) -> Vec<(Vec<f32>, IterLog)> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

/// Runs `n` peers of this process on Flex.
fn peers<T: Send>(
    n: usize,
    body: impl Fn(Arc<BurnPeer<Flex>>) -> memsave::Result<T> + Sync,
) -> memsave::Result<Vec<T>> {
    run_local::<Flex, T, _>(&Topology::local(n), vec![Default::default(); n], body)
}

/// Final weights and per-step trace of each of 2 peers, each running `hook()` at batch `batch`.
fn two_peers(
    name: &str,
    hook: impl Fn() -> OptimizerHook + Sync,
    batch: usize,
    samples: usize,
    length: RunLength,
) -> Vec<(Vec<f32>, Vec<(Vec<f32>, IterLog)>)> {
    let dir = work_dir(name);
    peers(2, |peer| {
        let shard = peer.shard();
        let mut runner = peer_runner(
            net(),
            hook(),
            data(batch, samples, shard),
            length,
            &dir,
            peer,
        );
        let trace = Trace::default();
        runner.register_hook(Box::new(trace.clone()));
        runner.run()?;
        Ok((weights(&runner.into_model()), trace.take()))
    })
    .unwrap()
}

/// The final weights of one process at batch `batch`.
fn alone(
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

fn assert_close(a: &[f32], b: &[f32], tolerance: f32) -> f32 {
    let difference = common::max_relative_difference(a, b);
    assert!(
        difference <= tolerance,
        "relative difference {difference} > {tolerance}"
    );
    difference
}

/// Peers hold the same bits after every iteration.
fn assert_identical_peers(runs: &[(Vec<f32>, Vec<(Vec<f32>, IterLog)>)]) {
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

#[test]
fn two_peers_at_batch_2_train_like_one_process_at_batch_4() {
    let _turn = turn();
    let plain = || OptimizerHook::new().with_grad_clip(clip());
    let runs = watchdog(120, move || {
        two_peers("plain", plain, 2, 16, RunLength::Epochs(2))
    });
    let single = alone("plain-1", plain(), 4, 16, RunLength::Epochs(2));
    assert_identical_peers(&runs);
    assert_eq!(runs[0].1.len(), 8, "4 iterations per epoch on each peer");
    assert!(runs[0].1.iter().all(|(_, log)| log.stepped));
    assert_ne!(single, weights(&net()), "training moved the weights");
    let difference = assert_close(&runs[0].0, &single, 1e-6);
    eprintln!("2 peers x batch 2 vs batch 4: max relative difference {difference:e}");
}

#[test]
fn accumulation_over_two_peers_equals_the_whole_batch_and_reduces_once_per_group() {
    let _turn = turn();
    let dir = work_dir("accumulation");
    let reduced = Arc::new(Mutex::new(Vec::<usize>::new()));
    let record = reduced.clone();
    let runs = watchdog(120, move || {
        peers(2, |peer| {
            let counting = Arc::new(Counting {
                inner: peer,
                elements: AtomicUsize::new(0),
            });
            let mut hook = GradientCumulativeOptimizerHook::new(2).unwrap();
            hook.grad_clip = clip();
            let shard = counting.shard();
            let mut runner = peer_runner(
                net(),
                hook,
                data(1, 16, shard),
                RunLength::Epochs(2),
                &dir,
                counting.clone(),
            );
            runner.register_hook(Box::new(PerIteration {
                counting: counting.clone(),
                seen: 0,
                out: if counting.rank() == 0 {
                    Some(record.clone())
                } else {
                    None
                },
            }));
            let trace = Trace::default();
            runner.register_hook(Box::new(trace.clone()));
            runner.run()?;
            Ok((weights(&runner.into_model()), trace.take()))
        })
        .unwrap()
    });
    let single = alone(
        "accumulation-1",
        OptimizerHook::new().with_grad_clip(clip()),
        4,
        16,
        RunLength::Epochs(2),
    );
    assert_identical_peers(&runs);
    let difference = assert_close(&runs[0].0, &single, 1e-6);
    eprintln!(
        "2 peers x batch 1 x 2 micro-steps vs batch 4: max relative difference {difference:e}"
    );
    // Elements all-reduced per iteration: the logged loss alone on the first micro-step of a
    // group, the gradients (and the bookkeeping) at the group's end.
    let params = weights(&net()).len();
    let reduced = reduced.lock().unwrap();
    assert_eq!(reduced.len(), 16);
    for (iter, &elements) in reduced.iter().enumerate() {
        if iter % 2 == 0 {
            assert!(
                elements <= 2,
                "iteration {iter} (mid-group) reduced {elements} elements"
            );
        } else {
            assert!(
                elements >= params,
                "iteration {iter} (group end) reduced {elements} < {params}"
            );
            assert!(
                elements <= params + 64,
                "iteration {iter} reduced the gradients more than once"
            );
        }
    }
}

/// A peer that counts the elements it all-reduces.
struct Counting {
    inner: Arc<BurnPeer<Flex>>,
    elements: AtomicUsize,
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
struct PerIteration {
    counting: Arc<Counting>,
    seen: usize,
    out: Option<Arc<Mutex<Vec<usize>>>>,
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

#[test]
fn fp16_with_a_dynamic_scale_over_two_peers_trains_like_one_process() {
    let _turn = turn();
    let scaler = || LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 1000).unwrap();
    let hook = move || Fp16OptimizerHook::new(scaler()).with_grad_clip(clip());
    let runs = watchdog(120, move || {
        two_peers("fp16", hook, 2, 16, RunLength::Epochs(2))
    });
    let single = alone("fp16-1", hook(), 4, 16, RunLength::Epochs(2));
    assert_identical_peers(&runs);
    assert!(runs[0]
        .1
        .iter()
        .all(|(_, log)| log.loss_scale == Some(1024.0)));
    // Half precision rounds two half batches differently from one batch (the tolerance of the
    // single-process fp16 accumulation test).
    let difference = assert_close(&runs[0].0, &single, 1e-2);
    eprintln!("fp16: 2 peers x batch 2 vs batch 4: max relative difference {difference:e}");
}

/// Batches whose images are inf at one iteration, on one peer only.
struct PoisonedOnRank1 {
    inner: Data,
    rank: usize,
    at: usize,
}

impl DataSource<AB, ClassificationBatch<AB>> for PoisonedOnRank1 {
    fn batches_per_epoch(&self) -> usize {
        self.inner.batches_per_epoch()
    }

    fn batch(
        &self,
        epoch: usize,
        index: usize,
        device: &burn::tensor::Device<AB>,
    ) -> memsave::Result<ClassificationBatch<AB>> {
        let mut batch = self.inner.batch(epoch, index, device)?;
        if self.rank == 1 && epoch * self.batches_per_epoch() + index == self.at {
            batch.images = batch.images.mul_scalar(0.0).add_scalar(f32::INFINITY);
        }
        Ok(batch)
    }
}

#[test]
fn an_overflow_on_one_peer_skips_the_step_on_every_peer_and_halves_both_scales() {
    let _turn = turn();
    let dir = work_dir("overflow");
    let runs = watchdog(120, move || {
        peers(2, |peer| {
            let scaler = LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 1000).unwrap();
            let source = PoisonedOnRank1 {
                inner: data(2, 16, peer.shard()),
                rank: peer.rank(),
                at: 2,
            };
            let mut runner = peer_runner(
                net(),
                Fp16OptimizerHook::new(scaler),
                source,
                RunLength::Iters(4),
                &dir,
                peer,
            );
            let trace = Trace::default();
            runner.register_hook(Box::new(trace.clone()));
            runner.run()?;
            Ok((weights(&runner.into_model()), trace.take()))
        })
        .unwrap()
    });
    assert_identical_peers(&runs);
    for (rank, (_, trace)) in runs.iter().enumerate() {
        let logs: Vec<&IterLog> = trace.iter().map(|(_, log)| log).collect();
        assert!(
            logs[1].stepped && !logs[2].stepped && logs[3].stepped,
            "rank {rank}"
        );
        assert_eq!(logs[1].loss_scale, Some(1024.0), "rank {rank}");
        assert_eq!(
            logs[2].loss_scale,
            Some(512.0),
            "rank {rank}: the scale backs off"
        );
        assert!(
            trace[1].0 == trace[2].0,
            "rank {rank}: the skipped step changed the weights"
        );
        assert!(
            trace[2].0 != trace[3].0,
            "rank {rank}: the next step moved them"
        );
    }
}

/// Batches that fail at one iteration on one peer: a missing image, or a panic.
struct FailsOnRank1 {
    inner: Data,
    rank: usize,
    at: usize,
    panic: bool,
}

impl DataSource<AB, ClassificationBatch<AB>> for FailsOnRank1 {
    fn batches_per_epoch(&self) -> usize {
        self.inner.batches_per_epoch()
    }

    fn batch(
        &self,
        epoch: usize,
        index: usize,
        device: &burn::tensor::Device<AB>,
    ) -> memsave::Result<ClassificationBatch<AB>> {
        if self.rank == 1 && epoch * self.batches_per_epoch() + index == self.at {
            if self.panic {
                panic!("a data thread fell over");
            }
            return Err(memsave::Error::Data("image 17.jpg is missing".into()));
        }
        self.inner.batch(epoch, index, device)
    }
}

#[test]
fn a_failing_peer_ends_every_peer_with_an_error_naming_it_and_the_checkpoints_stay_whole() {
    let _turn = turn();
    for panic in [false, true] {
        let dir = work_dir(if panic { "fail-panic" } else { "fail-error" });
        let run_dir = dir.clone();
        let result = watchdog(120, move || {
            peers(2, |peer| {
                let source = FailsOnRank1 {
                    inner: data(2, 16, peer.shard()),
                    rank: peer.rank(),
                    at: 5,
                    panic,
                };
                let plain = OptimizerHook::new();
                let length = RunLength::Iters(8);
                let mut runner = peer_runner(net(), plain, source, length, &run_dir, peer);
                runner.register_hook(Box::new(memsave::hooks::SnapshotHook::new(2, false)));
                runner.run()
            })
        });
        let error = result.expect_err("the run must fail").to_string();
        assert!(error.contains("peer rank 1"), "{error}");
        if panic {
            assert!(
                error.contains("panicked") && error.contains("fell over"),
                "{error}"
            );
        } else {
            assert!(error.contains("17.jpg"), "{error}");
        }
        // Rank 0 wrote checkpoints after iterations 2 and 4, whole; rank 1 wrote none.
        let latest = dir.join("latest.ckpt");
        let snapshot = memsave::train::Snapshot::load(&latest).expect("the last checkpoint loads");
        assert_eq!(snapshot.meta.iter, 4);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn every_peer_starts_from_rank_0s_weights() {
    let _turn = turn();
    let starts = watchdog(60, || {
        peers(3, |peer| {
            // Each peer draws other weights; rank 0's win.
            let model = TinyNet::<AB>::new(4, false, &Default::default())
                .map(&mut common::tiny::Seeded(100 + peer.rank() as u64));
            let mine = weights(&model);
            let dir = work_dir(&format!("broadcast-{}", peer.rank()));
            let source = data(1, 6, peer.shard());
            let mut runner = peer_runner(
                model,
                OptimizerHook::new(),
                source,
                RunLength::Iters(1),
                &dir,
                peer,
            );
            let trace = Trace::default();
            runner.register_hook(Box::new(StartRecorder(trace.clone())));
            runner.run()?;
            Ok((mine, trace.take()))
        })
        .unwrap()
    });
    let rank0 = &starts[0].0;
    assert!(starts[1].0 != *rank0, "the peers drew different weights");
    for (rank, (_, seen)) in starts.iter().enumerate() {
        assert!(
            seen[0].0 == *rank0,
            "rank {rank} did not start from rank 0's weights"
        );
    }
}

/// The weights as the first iteration starts.
struct StartRecorder(Trace);

impl Hook<AB, Net> for StartRecorder {
    fn name(&self) -> &'static str {
        "start"
    }

    fn before_iter(&mut self, state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        if state.iter == 0 {
            self.0
                 .0
                .lock()
                .unwrap()
                .push((weights(&state.model), IterLog::default()));
        }
        Ok(())
    }
}

#[test]
fn bad_topologies_are_errors_naming_the_flag() {
    let mut topology = Topology::local(2);
    topology.nodes = 2;
    let error = topology.check().unwrap_err().to_string();
    assert!(error.contains("--orchestrator"), "{error}");
    topology.orchestrator = Some("127.0.0.1:3000".into());
    let error = topology.check().unwrap_err().to_string();
    assert!(
        error.contains("--orchestrator") && error.contains("ws://"),
        "{error}"
    );
    topology.orchestrator = Some("ws://127.0.0.1:3000".into());
    topology.data_port = 3001;
    topology.node_rank = 2;
    let error = topology.check().unwrap_err().to_string();
    assert!(error.contains("--node-rank"), "{error}");
    let error = Topology::local(0).check().unwrap_err().to_string();
    assert!(error.contains("--devices"), "{error}");
}

/// Every gradient of `model` by parameter, flattened (None: no gradient).
fn grads_of(model: &Net, grads: &burn::optim::GradientsParams) -> Vec<Option<Vec<f32>>> {
    struct All<'a>(&'a burn::optim::GradientsParams, Vec<Option<Vec<f32>>>);
    impl ModuleVisitor<AB> for All<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let grad = self.0.get::<Flex, D>(param.id);
            self.1.push(grad.map(common::values));
        }
    }
    let mut all = All(grads, Vec::new());
    model.visit(&mut all);
    all.1
}

#[test]
fn gradients_are_averaged_in_buckets_and_a_gradient_on_one_peer_only_is_averaged_with_zeros() {
    let _turn = turn();
    let results = watchdog(60, || {
        peers(2, |peer| {
            // The spare parameter is used by no peer; the classifier's bias only by rank 0.
            let model =
                TinyNet::<AB>::new(4, true, &Default::default()).map(&mut common::tiny::Seeded(7));
            let batch = data(2, 8, peer.shard()).batch(0, 0, &Default::default())?;
            let loss = memsave::train::TrainModel::loss(&model, batch);
            let mut grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
            if peer.rank() == 1 {
                grads.remove::<Flex, 1>(model.fc.bias.as_ref().unwrap().id);
            }
            let mine = grads_of(&model, &grads);
            let mut one_each = clone_grads(&model, &grads);
            let mut whole = clone_grads(&model, &grads);
            let device = Default::default();
            memsave::parallel::all_reduce_grads_in_buckets::<AB, Net>(
                &*peer,
                &model,
                &mut one_each,
                &device,
                1,
            )?;
            memsave::parallel::all_reduce_grads::<AB, Net>(&*peer, &model, &mut whole, &device)?;
            Ok((mine, grads_of(&model, &one_each), grads_of(&model, &whole)))
        })
        .unwrap()
    });
    let (rank0, rank1) = (&results[0], &results[1]);
    // One bucket per gradient, or all in one: the same bits, the same on both peers.
    assert_eq!(rank0.1, rank0.2);
    assert_eq!(rank0.1, rank1.1);
    assert_eq!(rank1.1, rank1.2);
    let spare = rank0.0.len() - 1;
    for (index, averaged) in rank0.1.iter().enumerate() {
        match (&rank0.0[index], &rank1.0[index]) {
            (None, None) => assert!(
                averaged.is_none(),
                "parameter {index}: no gradient anywhere"
            ),
            (Some(a), Some(b)) => {
                let expected: Vec<f32> = a.iter().zip(b).map(|(a, b)| (a + b) / 2.0).collect();
                assert_eq!(averaged.as_ref().unwrap(), &expected, "parameter {index}");
            }
            (Some(a), None) => {
                let expected: Vec<f32> = a.iter().map(|a| a / 2.0).collect();
                assert_eq!(
                    averaged.as_ref().unwrap(),
                    &expected,
                    "parameter {index}: with zeros"
                );
            }
            (None, Some(_)) => unreachable!(),
        }
    }
    assert!(
        rank0.0[spare].is_none(),
        "the spare parameter is used by no peer"
    );
}

/// A copy of every gradient of `model` in `grads`.
fn clone_grads(model: &Net, grads: &burn::optim::GradientsParams) -> burn::optim::GradientsParams {
    struct Copy<'a>(
        &'a burn::optim::GradientsParams,
        burn::optim::GradientsParams,
    );
    impl ModuleVisitor<AB> for Copy<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(grad) = self.0.get::<Flex, D>(param.id) {
                self.1.register::<Flex, D>(param.id, grad);
            }
        }
    }
    let mut copy = Copy(grads, burn::optim::GradientsParams::new());
    model.visit(&mut copy);
    copy.1
}
