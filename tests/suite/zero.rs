//! ZeRO stages 1 and 2 on burn-collective (peers as threads of this process, on Flex): the
//! weights after every step are plain data parallelism's, bit for bit, with SGD, Adam and AdamW,
//! clipping, f16 with a dynamic scale, and accumulation; each peer keeps the optimizer state of
//! its part only; a snapshot holds the whole state, and resumes with 2 peers, 1 process, or from
//! a single process's snapshot into 2 peers.

use crate::common;

use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use burn::module::Module;
use common::dp::*;
use common::sometimes::{Sometimes, SometimesData};
use common::tiny::Seeded;
use common::{watchdog, AB};
use memsave::fp16::Precision;
use memsave::hooks::{
    Fp16OptimizerHook, GradientCumulativeOptimizerHook, OptimizerHook, SnapshotHook,
};
use memsave::parallel::{Collective, Shard, ZeroStage};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{IterLog, OptimizerKind, RunLength};

/// What one peer ends with: its final weights, its trace, and how many parameters its
/// optimizer keeps state for.
type PeerRun = (Vec<f32>, Vec<(Vec<f32>, IterLog)>, u64);

/// Entries in an optimizer state as `Optim::to_bytes` writes it (a count first).
fn entries(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes[..8].try_into().unwrap())
}

/// Two peers at batch 2 (16 samples, 2 epochs) with `optimizer` at `stage`.
fn run(
    name: &str,
    optimizer: &OptimizerKind,
    stage: ZeroStage,
    hook: impl Fn() -> OptimizerHook + Sync,
) -> Vec<PeerRun> {
    two_peers_with(name, optimizer, stage, hook, 2, 16, RunLength::Epochs(2))
}

/// Every step's weights, loss, norm and scale are the same bits in `a` and `b`.
fn assert_same_steps(a: &[PeerRun], b: &[PeerRun], what: &str) {
    for (peer_a, peer_b) in a.iter().zip(b) {
        assert_eq!(peer_a.1.len(), peer_b.1.len());
        for (step, (x, y)) in peer_a.1.iter().zip(&peer_b.1).enumerate() {
            assert!(
                x.0 == y.0,
                "{what}: the weights differ after iteration {step}"
            );
            assert_eq!(x.1.grad_norm, y.1.grad_norm, "{what}: iteration {step}");
            assert_eq!(x.1.loss_scale, y.1.loss_scale, "{what}: iteration {step}");
            assert_eq!(x.1.overflow, y.1.overflow, "{what}: iteration {step}");
        }
        assert!(peer_a.0 == peer_b.0, "{what}: the final weights differ");
    }
}

/// f16 with a dynamic scale and clipping: from 2^17 the first steps overflow (on either peer:
/// agreed), then it trains.
fn fp16() -> OptimizerHook {
    let scaler = LossScaler::new(131072.0, ScaleMode::Dynamic, 2.0, 1000).unwrap();
    Fp16OptimizerHook::new(scaler).with_grad_clip(clip())
}

/// Accumulation in groups of 3, clipped.
fn accumulate() -> OptimizerHook {
    GradientCumulativeOptimizerHook::new(3)
        .unwrap()
        .with_grad_clip(clip())
}

#[test]
fn stages_1_and_2_step_like_plain_data_parallelism_bit_for_bit() {
    let _turn = turn();
    let optimizers = [
        ("sgd", sgd()),
        ("adam", OptimizerKind::adam().with_weight_decay(1e-4)),
        ("adamw", OptimizerKind::adamw()),
    ];
    for (name, optimizer) in optimizers {
        let hook = || OptimizerHook::new().with_grad_clip(clip());
        let optimizer = Arc::new(optimizer);
        let (plain, one, two) = {
            let optimizer = optimizer.clone();
            watchdog(120, move || {
                (
                    run(&format!("{name}-0"), &optimizer, ZeroStage::Off, hook),
                    run(
                        &format!("{name}-1"),
                        &optimizer,
                        ZeroStage::OptimizerState,
                        hook,
                    ),
                    run(&format!("{name}-2"), &optimizer, ZeroStage::Gradients, hook),
                )
            })
        };
        assert_ne!(
            plain[0].0,
            weights(&net()),
            "{name}: training moved the weights"
        );
        assert_same_steps(&plain, &one, &format!("{name}, stage 1"));
        assert_same_steps(&plain, &two, &format!("{name}, stage 2"));
        // TinyNet's 4 parameters: conv.weight (216 values) on peer 0, the other 3 on peer 1.
        let whole = plain[0].2;
        if optimizer.state_copies() > 0 {
            assert_eq!(whole, 4, "{name}: plain keeps state for every parameter");
            for sharded in [&one, &two] {
                assert_eq!(
                    (sharded[0].2, sharded[1].2),
                    (1, 3),
                    "{name}: state per peer"
                );
            }
        }
    }
}

#[test]
fn f16_and_accumulation_under_stage_2_step_like_plain_data_parallelism() {
    let _turn = turn();
    let adam = OptimizerKind::adam();
    let runs = watchdog(120, move || {
        [
            (
                run("fp16-0", &adam, ZeroStage::Off, fp16),
                run("fp16-2", &adam, ZeroStage::Gradients, fp16),
            ),
            (
                run("acc-0", &adam, ZeroStage::Off, accumulate),
                run("acc-2", &adam, ZeroStage::Gradients, accumulate),
            ),
        ]
    });
    let [(plain16, zero16), (plain_acc, zero_acc)] = runs;
    assert_same_steps(&plain16, &zero16, "f16, stage 2");
    assert_same_steps(&plain_acc, &zero_acc, "accumulation, stage 2");
    assert!(
        plain16[0].1.iter().any(|(_, log)| log.overflow),
        "no step overflowed: the scale was never tested"
    );
}

/// Optimizer offload with peers: each peer keeps the state and steps the parameters of its
/// part on the host (stages 1 and 2), or all of them (plain data parallelism); the sums of
/// accumulation stay on the device, where each gradient's mean over the peers is made, and
/// under mixed precision the device keeps the fp32 model. Every step's weights are those of
/// the device's own step, bit for bit, and no peer's device optimizer holds any state. (On
/// Flex, host and device are one memory: staging is let run there to check what it computes.)
#[test]
fn optimizer_offload_with_peers_steps_each_part_on_its_host_like_the_devices_step() {
    use memsave::checkpoint::offload::stage_on_host_resident_backends;
    let _turn = turn();
    let adam = OptimizerKind::adam().with_weight_decay(1e-4);
    let offload = |hook: OptimizerHook| hook.with_optimizer_offload(true);
    let runs = watchdog(300, move || {
        // The switch is the run's: this thread's, which the peers inherit.
        stage_on_host_resident_backends(true);
        let clipped = || OptimizerHook::new().with_grad_clip(clip());
        let off = ZeroStage::Off;
        let one = ZeroStage::OptimizerState;
        let two = ZeroStage::Gradients;
        [
            (
                "clipping",
                run("off-clip-ref", &adam, off, clipped),
                vec![
                    run("off-clip-0", &adam, off, || offload(clipped())),
                    run("off-clip-1", &adam, one, || offload(clipped())),
                    run("off-clip-2", &adam, two, || offload(clipped())),
                ],
            ),
            (
                "f16",
                run("off-f16-ref", &adam, off, fp16),
                vec![run("off-f16-2", &adam, two, || offload(fp16()))],
            ),
            (
                "accumulation",
                run("off-acc-ref", &adam, off, accumulate),
                vec![run("off-acc-1", &adam, one, || offload(accumulate()))],
            ),
        ]
    });
    for (what, reference, others) in runs {
        assert_ne!(reference[0].0, weights(&net()), "{what}: training moved");
        assert_eq!(reference[0].2, 4, "{what}: the device's step keeps state");
        for (index, other) in others.iter().enumerate() {
            assert_same_steps(&reference, other, &format!("{what}, offloaded run {index}"));
            assert_eq!(
                (other[0].2, other[1].2),
                (0, 0),
                "{what}, offloaded run {index}: no state on the device"
            );
        }
    }
}

#[test]
fn the_step_in_backward_with_peers_steps_like_plain_data_parallelism_at_every_stage() {
    let _turn = turn();
    let adam = OptimizerKind::adam().with_weight_decay(1e-4);
    let in_backward = |hook: OptimizerHook| hook.with_step_in_backward(true);
    let runs = watchdog(300, move || {
        let plain = || OptimizerHook::new();
        let clipped = || OptimizerHook::new().with_grad_clip(clip());
        let off = ZeroStage::Off;
        let one = ZeroStage::OptimizerState;
        let two = ZeroStage::Gradients;
        [
            // One pass: each parameter steps as its averaged gradient arrives.
            (
                "one pass",
                run("sib-ref", &adam, off, plain),
                vec![
                    run("sib-0", &adam, off, || in_backward(plain())),
                    run("sib-1", &adam, one, || in_backward(plain())),
                    run("sib-2", &adam, two, || in_backward(plain())),
                ],
            ),
            // Two passes: the norm (gathered from the owners when sharded), then the step.
            (
                "clipping",
                run("sib-clip-ref", &adam, off, clipped),
                vec![
                    run("sib-clip-0", &adam, off, || in_backward(clipped())),
                    run("sib-clip-2", &adam, two, || in_backward(clipped())),
                ],
            ),
            (
                "f16",
                run("sib-f16-ref", &adam, off, fp16),
                vec![run("sib-f16-2", &adam, two, || in_backward(fp16()))],
            ),
            (
                "accumulation",
                run("sib-acc-ref", &adam, off, accumulate),
                vec![run("sib-acc-2", &adam, two, || in_backward(accumulate()))],
            ),
        ]
    });
    for (what, reference, others) in runs {
        assert_ne!(reference[0].0, weights(&net()), "{what}: training moved");
        for (index, other) in others.iter().enumerate() {
            assert_same_steps(&reference, other, &format!("{what}, run {index}"));
        }
    }
}

/// Optimizer offload's host bytes are the host's: every peer of this process is counted (a set
/// each at stage 0, their parts under ZeRO), as the check before `memsave train` and the
/// activation offload's limit count them. Each peer's state knows its process's peers.
#[test]
fn optimizer_offloads_host_bytes_count_every_peer_of_the_process() {
    use memsave::parallel::zero::owned_bytes;
    use memsave::train::params::{OffloadedOptimizer, OnThisHost};
    let _turn = turn();
    let places = watchdog(60, || {
        let dir = work_dir("places");
        peers(2, |peer| {
            let shard = peer.shard();
            let length = RunLength::Iters(1);
            let runner = peer_runner(
                net(),
                OptimizerHook::new(),
                data(2, 8, shard),
                length,
                &dir,
                peer,
            );
            Ok(runner.state().peer)
        })
        .unwrap()
    });
    for place in &places {
        assert_eq!(place.local_ranks(), 0..2, "{place:?}");
    }
    // A place that says nothing of its process: its own rank alone.
    let bare = memsave::train::PeerPlace {
        rank: 1,
        world_size: 2,
        ..memsave::train::PeerPlace::ALONE
    };
    assert_eq!(bare.local_ranks(), 1..2);
    assert_eq!(memsave::train::PeerPlace::new(1, 2).local_ranks(), 1..2);
    let model = net();
    let of = |accumulates: bool, host: &OnThisHost| {
        OffloadedOptimizer::of(&model, 2.0, accumulates, host)
    };
    let alone = of(true, &OnThisHost::alone());
    assert_eq!(
        (alone.state, alone.sums, alone.peers),
        (2 * alone.masters, alone.masters, 1)
    );
    // Two peers here, a whole set each; the sums stay on the device with peers.
    let whole_each = of(true, &OnThisHost::of(&places[0], false));
    assert_eq!(whole_each.masters, 2 * alone.masters);
    assert_eq!((whole_each.sums, whole_each.peers), (0, 2));
    // Under ZeRO the two parts here are the whole model once.
    let parts = of(true, &OnThisHost::of(&places[1], true));
    assert_eq!(parts.masters, alone.masters);
    // Two peers of four here (the second node): their two parts.
    let owned = owned_bytes(&model, 4);
    let node = OnThisHost {
        world: 4,
        local: 2..4,
        sharded: true,
    };
    let half = of(false, &node);
    assert_eq!(half.masters, owned[2] + owned[3]);
    assert!(
        half.masters < alone.masters && half.masters > 0,
        "{half:?} {owned:?}"
    );
    assert_eq!(half.total(), 3 * half.masters);
}

/// Heads that some micro-batches do not reach ([`Sometimes`]), under accumulation in groups of
/// 3. Peer 0 uses them at each group's first two micro-batches, peer 1 at iterations 0 and 5 of
/// every 6: at iteration 2 neither peer's last micro-batch reaches them, at 5 peer 1's does and
/// peer 0's does not. Where the gradients are averaged in backward (stage 2's reduction, the
/// step in backward), a peer whose last micro-batch did not reach a head sends its sum of the
/// earlier ones (in fp32 seeded on the head's tap, under f16 beside the half gradients), as
/// plain data parallelism does after backward; it sent zeros in fp32 before. One head's taps
/// run before the net's (their sums are sent during backward), the other's after, at the
/// backward's end: inside it (after it, peer 0's Burn graph cleanup waited for peer 1's graph,
/// held by a backward waiting for peer 0: a hang). Under f16 a gradient whose parameter no
/// earlier micro-batch reached is sent in fp32, as the others' sums are (the peers' all-reduce
/// failed on the two precisions, in plain data parallelism too).
#[test]
fn a_sum_a_peers_last_micro_batch_gives_nothing_to_is_averaged_in_backward_bit_for_bit() {
    let _turn = turn();
    let runs = watchdog(300, || {
        let model = || Sometimes::<AB>::new(&Default::default()).map(&mut Seeded(11));
        let data = |rank: usize, shard: Shard| {
            let uses: fn(usize) -> bool = match rank {
                0 => |iteration| iteration % 3 != 2,
                _ => |iteration| matches!(iteration % 6, 0 | 5),
            };
            SometimesData {
                inner: data(2, 16, shard),
                uses,
            }
        };
        let run = |name: &str, stage, hook: &(dyn Fn() -> OptimizerHook + Sync)| {
            two_peers_of(name, model, data, &sgd(), stage, hook, RunLength::Iters(12))
        };
        let cumulative = || GradientCumulativeOptimizerHook::new(3).unwrap();
        let clipped = || cumulative().with_grad_clip(clip());
        let mixed = || {
            let scaler = LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 1000).unwrap();
            cumulative().with_mixed_precision(scaler, Precision::F16)
        };
        let (off, two) = (ZeroStage::Off, ZeroStage::Gradients);
        let hooks: [(&str, &(dyn Fn() -> OptimizerHook + Sync)); 3] = [
            ("fp32", &cumulative),
            ("clipped", &clipped),
            ("f16", &mixed),
        ];
        hooks.map(|(what, hook)| {
            let in_backward = || hook().with_step_in_backward(true);
            let reference = run(&format!("heads-{what}"), off, hook);
            let others = vec![
                run(&format!("heads-{what}-2"), two, hook),
                run(&format!("heads-{what}-sib"), off, &in_backward),
                run(&format!("heads-{what}-sib-2"), two, &in_backward),
            ];
            (what, reference, others)
        })
    });
    for (what, reference, others) in runs {
        let start = weights(&Sometimes::<AB>::new(&Default::default()).map(&mut Seeded(11)));
        assert_ne!(reference[0].0, start, "{what}: training moved");
        for (index, other) in others.iter().enumerate() {
            assert_same_steps(&reference, other, &format!("{what}, run {index}"));
        }
    }
}

/// Peers (or one process: `peers == 1`) at stage 1 with Adam, 4 epochs in all, resuming from
/// `resume` when given and writing a snapshot after every epoch in `dir`; the final weights.
fn train(peers_n: usize, dir: &Path, epochs: usize, resume: Option<&Path>) -> Vec<f32> {
    train_at(ZeroStage::OptimizerState, peers_n, dir, epochs, resume)
}

fn train_at(
    stage: ZeroStage,
    peers_n: usize,
    dir: &Path,
    epochs: usize,
    resume: Option<&Path>,
) -> Vec<f32> {
    let adam = OptimizerKind::adam();
    let dir = dir.to_path_buf();
    let resume = resume.map(Path::to_path_buf);
    let finals = peers(peers_n, |peer| {
        let shard = peer.shard();
        // One process at batch 4 sees what 2 peers at batch 2 see together.
        let batch = 4 / peers_n;
        let mut runner = peer_runner_with(
            net(),
            &adam,
            stage,
            OptimizerHook::new().with_grad_clip(clip()),
            data(batch, 16, shard),
            RunLength::Epochs(epochs),
            &dir,
            peer,
        );
        runner.register_hook(Box::new(SnapshotHook::new(1, true)));
        if let Some(resume) = &resume {
            runner.resume(resume)?;
        }
        runner.run()?;
        Ok(weights(&runner.into_model()))
    })
    .unwrap();
    finals.into_iter().next().unwrap()
}

#[test]
fn a_snapshot_holds_the_whole_state_and_resumes_with_2_peers_1_process_or_from_1_into_2() {
    let _turn = turn();
    let dir = work_dir("zero-resume");
    let (whole, two_two, two_one, one_two, single, state) = watchdog(300, move || {
        let whole = train(2, &dir.join("whole"), 4, None);
        let _ = train(2, &dir.join("half"), 2, None);
        let snapshot = dir.join("half").join("epoch_2.ckpt");
        let state = memsave::train::Snapshot::load(&snapshot).unwrap().optimizer;
        let two_two = train(2, &dir.join("2-2"), 4, Some(&snapshot));
        let two_one = train(1, &dir.join("2-1"), 4, Some(&snapshot));
        let single = train(1, &dir.join("single"), 4, None);
        let _ = train(1, &dir.join("single-half"), 2, None);
        let from_one = dir.join("single-half").join("epoch_2.ckpt");
        let one_two = train(2, &dir.join("1-2"), 4, Some(&from_one));
        let _ = std::fs::remove_dir_all(&dir);
        (whole, two_two, two_one, one_two, single, entries(&state))
    });
    assert_eq!(
        state, 4,
        "the snapshot of 2 peers holds every parameter's state"
    );
    assert!(
        two_two == whole,
        "2 -> 2 differs from the uninterrupted run"
    );
    // One process at batch 4 against 2 peers at batch 2: the tolerance of the plain
    // data-parallel test.
    let d21 = assert_close(&two_one, &whole, 1e-6);
    let d12 = assert_close(&one_two, &single, 1e-6);
    eprintln!("resume 2 -> 1: {d21:e}; 1 -> 2: {d12:e} (max relative difference)");
}

#[test]
fn the_stage_traffic_per_step_is_the_gradients_and_the_parameters() {
    let _turn = turn();
    let adam = OptimizerKind::adam();
    let per_step = watchdog(120, move || {
        [
            ZeroStage::Off,
            ZeroStage::OptimizerState,
            ZeroStage::Gradients,
        ]
        .map(|stage| {
            let dir = work_dir(&format!("traffic-{}", stage.number()));
            let counts = peers(2, |peer| {
                let counting = Arc::new(Counting {
                    inner: peer,
                    elements: AtomicUsize::new(0),
                });
                let shard: Shard = counting.shard();
                let mut runner = peer_runner_with(
                    net(),
                    &adam,
                    stage,
                    OptimizerHook::new().with_grad_clip(clip()),
                    data(2, 16, shard),
                    RunLength::Iters(4),
                    &dir,
                    counting.clone(),
                );
                runner.run()?;
                Ok(counting.elements.load(std::sync::atomic::Ordering::SeqCst))
            })
            .unwrap();
            counts[0] / 4
        })
    });
    let params = weights(&net()).len();
    eprintln!("elements all-reduced per step with {params} parameters: {per_step:?}");
    // Plain: the gradients, the start's broadcast of the weights over the 4 steps, and a few
    // values of bookkeeping. Stage 1: the parameters once more each step (the owners' new
    // values, -0.0 from the others). Stage 2: and each parameter's norm part with a flag (2
    // values a parameter).
    assert!(per_step[0] >= params + params / 4 && per_step[0] < params + params / 4 + 64);
    assert_eq!(per_step[1], per_step[0] + params);
    assert_eq!(per_step[2], per_step[1] + 2 * 4);
}

#[test]
fn a_bad_stage_is_an_error_naming_the_key() {
    let error = ZeroStage::from_number(3).unwrap_err().to_string();
    assert!(error.contains("zero_stage"), "{error}");
}
