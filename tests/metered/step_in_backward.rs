//! The optimizer's step in backward (`step_in_backward`, REFERENCE.md section 7): each
//! parameter steps as soon as its gradient is final and the gradient is freed. Checked against
//! the ordinary step bit for bit: every optimizer with and without weight decay, BatchNorm
//! trained and frozen, checkpointing, dropout, clipping and mixed precision (two passes, an
//! overflow skipped), accumulation; and the memory it saves, measured.

use crate::common;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::prelude::*;
use common::mlp::Mlp;
use common::sometimes::{Sometimes, SometimesData};
use common::tiny::{Seeded, TinyNet};
use common::AB;
use memsave::checkpoint::set_with_cp;
use memsave::config::{Config, ConfigHooks};
use memsave::fp16::Precision;
use memsave::hooks::{
    GradClip, Groups, LoggerHook, LrSchedule, LrUpdaterHook, OptimizerHook, SnapshotHook, Warmup,
};
use memsave::memory::AllocatorMeter;
use memsave::models::classifier::ImageClassifier;
use memsave::models::config::{ClassifierSection, DataSection};
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::models::resnet::ResNetConfig;
use memsave::planner::StepMeter;
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::snapshot::codec::{load_bytes, record_bytes};
use memsave::train::{
    DataSource, Hook, IterLog, OptimizerKind, OptimizerSpec, PeerPlace, RunLength, Runner,
    Snapshot, StateDtype, TrainModel, TrainState,
};

/// One test at a time: the memory test reads the process-wide allocator's counts.
use crate::TURN as SERIAL;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn data(batch: usize, samples: usize, size: usize) -> SyntheticClassification<AB> {
    let mut config = SyntheticClassificationConfig::new(batch, samples, size);
    config.seed = 3;
    config.noise = 1.0;
    config.signal = 0.5;
    SyntheticClassification::new(config, 4, Default::default()).unwrap()
}

fn sgd() -> OptimizerKind {
    OptimizerKind::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
        nesterov: false,
    }
}

fn adam_w() -> OptimizerKind {
    OptimizerKind::AdamW {
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

fn work_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-sib-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Keeps each iteration's log.
struct Recorder(Arc<Mutex<Vec<IterLog>>>);

impl<M: TrainModel<AB>> Hook<AB, M> for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn after_iter(&mut self, state: &mut TrainState<AB, M>) -> memsave::Result<()> {
        self.0.lock().unwrap().push(state.log.clone());
        Ok(())
    }
}

/// What a run ends with: the model's record (weights and running statistics), the optimizer's
/// state, the loss scaler's, each iteration's log.
#[derive(Debug, PartialEq)]
struct Outcome {
    model: Vec<u8>,
    optimizer: Vec<u8>,
    hooks: std::collections::BTreeMap<String, serde_json::Value>,
    logs: Vec<IterLog>,
}

/// Trains `model` for `iters` iterations with `hook` and `optimizer` at lr 0.05.
fn train<M, D>(
    model: M,
    data: D,
    optimizer: impl Into<OptimizerSpec>,
    hook: OptimizerHook,
    iters: usize,
    name: &str,
) -> Outcome
where
    M: TrainModel<AB>,
    D: DataSource<AB, M::Batch>,
{
    let dir = work_dir(name);
    let mut runner = Runner::new(
        model,
        optimizer,
        Box::new(hook),
        data,
        RunLength::Iters(iters),
        &dir,
        Default::default(),
    )
    .unwrap();
    // A warm-up: the learning rate changes every iteration (read once per step).
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule {
            warmup: Some(Warmup::Linear),
            warmup_iters: 5,
            ..LrSchedule::constant(0.05)
        },
    }));
    // MMCV's logger and a snapshot every 2 iterations, as a run has them.
    runner.register_hook(Box::new(LoggerHook::new(2)));
    runner.register_hook(Box::new(SnapshotHook::new(2, false)));
    let logs = Arc::new(Mutex::new(Vec::new()));
    runner.register_hook(Box::new(Recorder(logs.clone())));
    runner.run().unwrap();
    // The hooks' state (the loss scaler's, the group's position) as a snapshot keeps it.
    let end = dir.join("end.ckpt");
    runner.save_snapshot(&end).unwrap();
    let hooks = Snapshot::load(&end).unwrap().meta.hooks;
    let state = runner.state();
    let outcome = Outcome {
        model: record_bytes::<AB, _>(state.model.clone().into_record()).unwrap(),
        optimizer: state.optimizer.to_bytes().unwrap(),
        hooks,
        logs: logs.lock().unwrap().clone(),
    };
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

/// The same run with the step in backward and without, from copies of `model` (whose running
/// statistics are not shared: `model()` makes a new one each time): equal in every bit.
fn same<M, D>(
    model: impl Fn() -> M,
    data: impl Fn() -> D,
    optimizer: impl Into<OptimizerSpec>,
    hook: impl Fn() -> OptimizerHook,
    iters: usize,
    name: &str,
) -> Outcome
where
    M: TrainModel<AB>,
    D: DataSource<AB, M::Batch>,
{
    let optimizer: OptimizerSpec = optimizer.into();
    let ordinary = train(model(), data(), &optimizer, hook(), iters, name);
    let in_backward = train(
        model(),
        data(),
        &optimizer,
        hook().with_step_in_backward(true),
        iters,
        &format!("{name}-sib"),
    );
    assert!(
        ordinary.logs.iter().any(|log| log.stepped),
        "{name}: no step was taken"
    );
    assert_eq!(
        ordinary.logs.len(),
        in_backward.logs.len(),
        "{name}: iterations"
    );
    for (iter, (a, b)) in ordinary.logs.iter().zip(&in_backward.logs).enumerate() {
        assert_eq!(a.loss, b.loss, "{name}: loss at iteration {iter}");
        assert_eq!(a.grad_norm, b.grad_norm, "{name}: norm at iteration {iter}");
        assert_eq!(
            a.loss_scale, b.loss_scale,
            "{name}: scale at iteration {iter}"
        );
        assert_eq!(a.stepped, b.stepped, "{name}: stepped at iteration {iter}");
        // In backward, each parameter steps on its own (the ordinary step: in a few groups).
        if b.stepped {
            assert!(
                b.step_groups > a.step_groups,
                "{name}: iteration {iter} did not step in backward"
            );
        }
    }
    assert!(
        ordinary.model == in_backward.model,
        "{name}: the weights differ"
    );
    assert!(
        ordinary.optimizer == in_backward.optimizer,
        "{name}: the optimizer's state differs"
    );
    assert_eq!(
        ordinary.hooks, in_backward.hooks,
        "{name}: the hooks' state"
    );
    ordinary
}

/// Makers of copies of one model (`make`'s, its weights drawn with `seed`): the same weights,
/// ids and running statistics every time, none shared between two copies.
fn copies<M: Module<AB>>(make: impl Fn() -> M, seed: u64) -> impl Fn() -> M {
    let bytes = record_bytes::<AB, _>(make().map(&mut Seeded(seed)).into_record()).unwrap();
    move || make().load_record(load_bytes::<AB, _>(&bytes, &Default::default()).unwrap())
}

fn tiny() -> TinyNet<AB> {
    thread_local! {
        static BYTES: Vec<u8> = record_bytes::<AB, _>(
            TinyNet::<AB>::new(4, false, &Default::default()).map(&mut Seeded(7)).into_record(),
        )
        .unwrap();
    }
    let record = BYTES.with(|bytes| load_bytes::<AB, _>(bytes, &Default::default()).unwrap());
    TinyNet::new(4, false, &Default::default()).load_record(record)
}

#[test]
fn every_optimizer_steps_in_backward_bit_for_bit_as_after_it() {
    let _serial = serial();
    let optimizers = [
        ("sgd", sgd()),
        (
            "sgd-nesterov",
            OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: true,
            },
        ),
        (
            "sgd-plain",
            OptimizerKind::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
            },
        ),
        (
            "adam",
            OptimizerKind::Adam {
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 0.0,
            },
        ),
        (
            "adam-decay",
            OptimizerKind::Adam {
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 1e-2,
            },
        ),
        (
            "adamw",
            OptimizerKind::AdamW {
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 0.01,
            },
        ),
    ];
    for (name, optimizer) in optimizers {
        let outcome = same(
            tiny,
            || data(4, 16, 8),
            &optimizer,
            OptimizerHook::new,
            6,
            name,
        );
        assert!(outcome.logs.iter().all(|log| log.grad_norm.is_some()));
    }
    // The 8-bit state (quantized: the MLP's layers are large enough).
    let mlp = copies(
        || Mlp::<AB>::new(3 * 8 * 8, 128, 3, 0.0, &Default::default()),
        5,
    );
    for kind in [sgd(), adam_w()] {
        let spec = kind.with_state_dtype(StateDtype::Int8);
        same(
            &mlp,
            || data(4, 16, 8),
            &spec,
            OptimizerHook::new,
            4,
            "int8",
        );
    }
}

/// A narrow ResNet-18 classifier (BatchNorm in every block), the same weights, ids and running
/// statistics every time (none shared between two calls).
fn resnet(frozen_stages: i64, with_cp: bool) -> impl Fn() -> ImageClassifier<AB> {
    let config = ResNetConfig {
        depth: 18,
        base_channels: 8,
        frozen_stages,
        ..ResNetConfig::default()
    };
    let copy = copies(
        move || ImageClassifier::<AB>::new(&config, 4, &Default::default()).unwrap(),
        11,
    );
    move || set_with_cp(copy(), with_cp)
}

#[test]
fn batch_norm_trained_or_frozen_and_checkpointing_step_in_backward_bit_for_bit() {
    let _serial = serial();
    let data = || data(4, 16, 32);
    same(
        resnet(-1, false),
        data,
        &sgd(),
        OptimizerHook::new,
        4,
        "resnet",
    );
    same(
        resnet(1, false),
        data,
        &sgd(),
        OptimizerHook::new,
        4,
        "resnet-frozen",
    );
    same(
        resnet(-1, true),
        data,
        &sgd(),
        OptimizerHook::new,
        4,
        "resnet-cp",
    );
    let adam = adam_w();
    same(
        resnet(-1, true),
        data,
        &adam,
        OptimizerHook::new,
        3,
        "resnet-cp-adamw",
    );
}

fn clipped() -> OptimizerHook {
    OptimizerHook::new().with_grad_clip(Some(GradClip::new(0.5, 2.0).unwrap()))
}

#[test]
fn clipping_takes_two_passes_and_clips_bit_for_bit() {
    let _serial = serial();
    let outcome = same(tiny, || data(4, 16, 8), &sgd(), clipped, 6, "clip");
    assert!(
        outcome
            .logs
            .iter()
            .any(|log| log.grad_norm.is_some_and(|norm| norm > 0.5)),
        "the clipping never acted: {:?}",
        outcome.logs
    );
    let inf =
        || OptimizerHook::new().with_grad_clip(Some(GradClip::new(0.1, f64::INFINITY).unwrap()));
    same(tiny, || data(4, 16, 8), &sgd(), inf, 4, "clip-inf");
    same(
        resnet(-1, true),
        || data(4, 16, 32),
        &sgd(),
        clipped,
        3,
        "clip-resnet-cp",
    );
}

#[test]
fn mixed_precision_skips_the_same_overflows_and_steps_bit_for_bit() {
    let _serial = serial();
    // From 2^20 the first steps overflow in f16 and are skipped; the later ones step.
    let mixed = || {
        OptimizerHook::new().with_mixed_precision(
            LossScaler::new(2f64.powi(20), ScaleMode::Dynamic, 2.0, 2).unwrap(),
            Precision::F16,
        )
    };
    let outcome = same(tiny, || data(4, 48, 8), &sgd(), mixed, 12, "fp16");
    assert!(outcome.logs.iter().any(|log| !log.stepped), "no overflow");
    assert!(outcome.logs.iter().any(|log| log.stepped), "no step");
    let clipped_mixed = || mixed().with_grad_clip(Some(GradClip::new(0.5, 2.0).unwrap()));
    same(
        resnet(-1, false),
        || data(4, 16, 32),
        &sgd(),
        clipped_mixed,
        6,
        "fp16-clip-resnet",
    );
    let bf16 = || {
        OptimizerHook::new().with_mixed_precision(
            LossScaler::new(512.0, ScaleMode::Static, 2.0, 1000).unwrap(),
            Precision::Bf16,
        )
    };
    same(tiny, || data(4, 16, 8), &sgd(), bf16, 4, "bf16");
}

#[test]
fn accumulation_steps_in_the_last_micro_batches_backward_bit_for_bit() {
    let _serial = serial();
    // Groups of 3 over 8 iterations: two whole groups and a short one of 2.
    let cumulative = || OptimizerHook::new().with_groups(Groups::new(3).unwrap());
    let outcome = same(tiny, || data(2, 16, 8), &sgd(), cumulative, 8, "accumulate");
    let steps: Vec<bool> = outcome.logs.iter().map(|log| log.stepped).collect();
    assert_eq!(steps, [false, false, true, false, false, true, false, true]);
    let clipped = || cumulative().with_grad_clip(Some(GradClip::new(0.5, 2.0).unwrap()));
    same(
        tiny,
        || data(2, 16, 8),
        &sgd(),
        clipped,
        7,
        "accumulate-clip",
    );
    let mixed = || {
        cumulative().with_mixed_precision(
            LossScaler::new(2f64.powi(16), ScaleMode::Dynamic, 2.0, 2).unwrap(),
            Precision::F16,
        )
    };
    let outcome = same(
        tiny,
        || data(2, 32, 8),
        &sgd(),
        mixed,
        14,
        "accumulate-fp16",
    );
    assert!(outcome.logs.iter().any(|log| log.stepped), "no step");
}

#[test]
fn a_sum_the_groups_last_micro_batch_gives_nothing_to_steps_alone_bit_for_bit() {
    let _serial = serial();
    let model = copies(|| Sometimes::new(&Default::default()), 11);
    // Groups of 3: the groups' last micro-batches (iterations 2 and 5) leave the heads out.
    let data = || SometimesData {
        inner: data(2, 16, 8),
        uses: |iteration| iteration % 3 != 2,
    };
    let cumulative = || OptimizerHook::new().with_groups(Groups::new(3).unwrap());
    let clipped = || cumulative().with_grad_clip(Some(GradClip::new(0.5, 2.0).unwrap()));
    let mixed = || {
        clipped().with_mixed_precision(
            LossScaler::new(2f64.powi(16), ScaleMode::Dynamic, 2.0, 2).unwrap(),
            Precision::F16,
        )
    };
    let plain_mixed = || {
        cumulative().with_mixed_precision(
            LossScaler::new(2f64.powi(16), ScaleMode::Dynamic, 2.0, 2).unwrap(),
            Precision::F16,
        )
    };
    same(&model, data, &sgd(), cumulative, 8, "sometimes");
    same(&model, data, &adam_w(), clipped, 8, "sometimes-clip");
    same(&model, data, &sgd(), plain_mixed, 8, "sometimes-fp16");
    same(&model, data, &adam_w(), mixed, 8, "sometimes-fp16-clip");
}

#[test]
fn dropout_masks_are_replayed_in_the_second_pass() {
    let _serial = serial();
    let mlp = copies(
        || Mlp::<AB>::new(3 * 8 * 8, 32, 3, 0.3, &Default::default()),
        5,
    );
    // Dropout draws from the backend's process-wide stream: both runs reseed it first.
    let run = |hook: OptimizerHook, name: &str| {
        AB::seed(&Default::default(), 42);
        train(mlp(), data(4, 16, 8), &sgd(), hook, 5, name)
    };
    let ordinary = run(clipped(), "dropout");
    let in_backward = run(clipped().with_step_in_backward(true), "dropout-sib");
    assert!(ordinary.model == in_backward.model, "the weights differ");
    let losses = |outcome: &Outcome| -> Vec<_> {
        outcome
            .logs
            .iter()
            .map(|log| (log.loss, log.grad_norm))
            .collect()
    };
    assert_eq!(losses(&ordinary), losses(&in_backward));
}

#[test]
fn the_step_in_backward_frees_the_gradients_and_lowers_the_peak() {
    let _serial = serial();
    // Six 512 x 512 layers: 6 MiB of gradients, far more than the activations of 4 samples.
    let mlp = Mlp::<AB>::new(3 * 8 * 8, 512, 6, 0.0, &Default::default()).map(&mut Seeded(5));
    let grad_bytes: u64 = {
        let (_, trainable) = memsave::train::params::param_bytes::<AB, _>(&mlp);
        trainable
    };
    let peak = |hook: OptimizerHook| {
        let dir = work_dir("peak");
        let mut runner = Runner::new(
            mlp.clone(),
            &sgd(),
            Box::new(hook),
            data(4, 16, 8),
            RunLength::Iters(4),
            &dir,
            Default::default(),
        )
        .unwrap();
        runner.register_hook(Box::new(LrUpdaterHook {
            schedule: LrSchedule::constant(0.05),
        }));
        let meter = StepMeter::new(2, 4, Box::new(AllocatorMeter));
        let steps = meter.steps.clone();
        runner.register_hook(Box::new(meter));
        runner.run().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let steps = steps.borrow().clone();
        steps.iter().map(|(_, peak)| *peak).max().unwrap()
    };
    let ordinary = peak(OptimizerHook::new());
    let in_backward = peak(OptimizerHook::new().with_step_in_backward(true));
    eprintln!(
        "step in backward: peak {:.2} MiB vs {:.2} MiB ordinary; gradients {:.2} MiB",
        in_backward as f64 / 1048576.0,
        ordinary as f64 / 1048576.0,
        grad_bytes as f64 / 1048576.0
    );
    // The ordinary step holds every gradient at once; in backward at most a few layers' worth.
    assert!(
        in_backward + grad_bytes / 2 < ordinary,
        "peak {in_backward} in backward vs {ordinary} ordinary ({grad_bytes} bytes of gradients)"
    );
}

#[test]
fn under_mixed_precision_a_middle_micro_batch_adds_each_gradient_to_its_sum_as_it_is_made() {
    let _serial = serial();
    // 24 layers of 256: 6 MiB of fp32 sums, 3 MiB of half gradients, none over 256 KiB.
    let mlp = Mlp::<AB>::new(3 * 8 * 8, 256, 24, 0.0, &Default::default()).map(&mut Seeded(5));
    let (_, sum_bytes) = memsave::train::params::param_bytes::<AB, _>(&mlp);
    let dir = work_dir("middle");
    let hook = OptimizerHook::new()
        .with_step_in_backward(true)
        .with_groups(Groups::new(3).unwrap())
        .with_mixed_precision(
            LossScaler::new(512.0, ScaleMode::Static, 2.0, 1000).unwrap(),
            Precision::F16,
        );
    let mut runner = Runner::new(
        mlp,
        &sgd(),
        Box::new(hook),
        data(4, 16, 8),
        RunLength::Iters(3),
        &dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.05),
    }));
    let meter = StepMeter::new(0, 2, Box::new(AllocatorMeter));
    let steps = meter.steps.clone();
    runner.register_hook(Box::new(meter));
    runner.run().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let peaks: Vec<u64> = steps.borrow().iter().map(|(_, peak)| *peak).collect();
    let (first, middle) = (peaks[0], peaks[1]);
    eprintln!(
        "mixed precision, groups of 3, step in backward: the group's first micro-batch peaks at \
         {:.2} MiB, its middle one at {:.2} MiB (sums {:.2} MiB in fp32)",
        first as f64 / 1048576.0,
        middle as f64 / 1048576.0,
        sum_bytes as f64 / 1048576.0
    );
    // The first ends with the fp32 sums; the middle one holds them and adds each half gradient
    // as it is made (an untapped backward made the whole half set beside them: a quarter of
    // the sums more at least).
    assert!(
        middle < first + sum_bytes / 4,
        "the middle micro-batch peaks at {middle}, the first at {first} ({sum_bytes} bytes of sums)"
    );
}

#[test]
fn the_step_in_backward_with_peers_but_no_peer_reducer_is_an_error_naming_it() {
    let _serial = serial();
    let dir = work_dir("ddp");
    let mut runner = Runner::new(
        tiny(),
        &sgd(),
        Box::new(OptimizerHook::new().with_step_in_backward(true)),
        data(4, 16, 8),
        RunLength::Iters(2),
        &dir,
        Default::default(),
    )
    .unwrap();
    runner.state_mut().peer = PeerPlace::new(0, 2);
    let message = runner.run().unwrap_err().to_string();
    assert!(
        message.contains("step_in_backward") && message.contains("PeerReducer"),
        "{message}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_config_switch_is_read() {
    let _serial = serial();
    let path = std::env::temp_dir().join(format!("memsave-sib-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "_base_ = \"CONFIGS/resnet18_synthetic.toml\"\n[optimizer_config]\nstep_in_backward = true\n"
            .replace("CONFIGS", concat!(env!("CARGO_MANIFEST_DIR"), "/configs")),
    )
    .unwrap();
    let on = Config::<ClassifierSection, DataSection>::load(&path, &[]).unwrap();
    let off = Config::<ClassifierSection, DataSection>::load(
        &path,
        &["optimizer_config.step_in_backward=false".to_string()],
    )
    .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(on.optimizer_hook_of().unwrap().step_in_backward);
    assert!(!off.optimizer_hook_of().unwrap().step_in_backward);
}
