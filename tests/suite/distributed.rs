//! Data parallelism on burn-collective (REFERENCE.md section 6), peers as threads of this process
//! on Flex: 2 peers x batch b train like one process at batch 2b (plain, with accumulation, in
//! fp16), peers hold the same bits after every step, an overflow on one peer skips the step on
//! all, a peer that fails ends the run on every peer with an error naming it.
//!
//! burn-collective keeps one server per backend in a process: the tests take turns.

use crate::common;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use common::dp::*;
use common::tiny::TinyNet;
use common::{watchdog, AB};
use memsave::hooks::{Fp16OptimizerHook, GradientCumulativeOptimizerHook, OptimizerHook};
use memsave::models::classifier::ClassificationBatch;
use memsave::parallel::{Collective, Topology, ZeroStage};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{DataSource, Hook, IterLog, RunLength, TrainState};

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
    // Plain, an error; plain, a panic; the optimizer state sharded (ZeRO stage 1), a panic of
    // the peer that holds the only copy of its part.
    for (panic, stage) in [
        (false, ZeroStage::Off),
        (true, ZeroStage::Off),
        (true, ZeroStage::OptimizerState),
    ] {
        let dir = work_dir(&format!("fail-{panic}-{}", stage.number()));
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
                let mut runner =
                    peer_runner_with(net(), &sgd(), stage, plain, source, length, &run_dir, peer);
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
        // Every parameter's momentum, the sharded run's gathered from both peers.
        let entries = u64::from_le_bytes(snapshot.optimizer[..8].try_into().unwrap());
        assert_eq!(entries, 4, "stage {}", stage.number());
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
