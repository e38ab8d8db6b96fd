//! Parameter compression (`[optimizer] weight_dtype = "bf16"`, REFERENCE.md section 7): the
//! trainable weights in 16 bits as their only copy, each fp32 update rounded back
//! stochastically, to nearest or with a Kahan compensation. Checked here: the weights are
//! 16-bit and half the bytes; each rounding is read (they give different weights, a seed gives
//! the same draws again); the step in backward gives the ordinary step's bits with every
//! optimizer and rounding, clipping, accumulation and mixed precision; ZeRO 1 and 2 give plain
//! data parallelism's bits; a resumed run continues exactly; snapshots of another type convert
//! with a notice, a missing or damaged compensation is an error naming the file; f16 weights
//! losing their updates warn with the share measured.

use crate::common;

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::DType;
use common::dp::*;
use common::tiny::Seeded;
use common::{watchdog, AB};
use memsave::fp16::Precision;
use memsave::hooks::{GradClip, GradientCumulativeOptimizerHook, OptimizerHook, SnapshotHook};
use memsave::parallel::{Collective, Shard, ZeroStage};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{
    IterLog, OptimizerKind, OptimizerSpec, RunLength, Snapshot, StateDtype, WeightDtype,
    WeightRounding, WeightSpec,
};

fn spec(kind: OptimizerKind, dtype: WeightDtype, rounding: WeightRounding) -> OptimizerSpec {
    kind.with_state_dtype(StateDtype::F32)
        .with_weights(WeightSpec::new(dtype, rounding).with_seed(5))
}

fn bf16(rounding: WeightRounding) -> OptimizerSpec {
    spec(sgd(), WeightDtype::Bf16, rounding)
}

fn adam_w() -> OptimizerKind {
    OptimizerKind::AdamW {
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// The dtypes of the model's float parameters.
fn dtypes<M: Module<AB>>(model: &M) -> Vec<DType> {
    struct All(Vec<DType>);
    impl ModuleVisitor<AB> for All {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.0.push(param.val().dtype());
        }
    }
    let mut all = All(Vec::new());
    model.visit(&mut all);
    all.0
}

/// A run of `iters` iterations of the tiny classifier at batch 4: its final weights (as
/// fp32), the trace, the weights' dtypes, and its warnings.
struct Run {
    weights: Vec<f32>,
    trace: Vec<(Vec<f32>, IterLog)>,
    dtypes: Vec<DType>,
    warnings: Vec<String>,
}

fn run(name: &str, optimizer: &OptimizerSpec, hook: OptimizerHook, iters: usize) -> Run {
    // Named apart from the other data-parallel files' runs (they share `work_dir`'s folder).
    run_in(
        &work_dir(&format!("weights-{name}")),
        optimizer,
        hook,
        iters,
        None,
        None,
    )
}

fn run_in(
    dir: &Path,
    optimizer: &OptimizerSpec,
    hook: OptimizerHook,
    iters: usize,
    snapshot_every: Option<usize>,
    resume: Option<&Path>,
) -> Run {
    let mut runner = runner_with(
        net(),
        optimizer,
        Box::new(hook),
        data(4, 32, Shard::whole()),
        RunLength::Iters(iters),
        dir,
    );
    if let Some(interval) = snapshot_every {
        runner.register_hook(Box::new(SnapshotHook::new(interval, false)));
    }
    if let Some(path) = resume {
        runner.resume(path).unwrap();
    }
    let trace = Trace::default();
    runner.register_hook(Box::new(trace.clone()));
    runner.run().unwrap();
    let warnings = runner.state().warnings().to_vec();
    let model = runner.into_model();
    Run {
        weights: weights(&model),
        trace: trace.take(),
        dtypes: dtypes(&model),
        warnings,
    }
}

#[test]
fn bf16_weights_are_the_only_copy_at_half_the_bytes_and_train() {
    let plain = run("plain", &sgd().into(), OptimizerHook::new(), 8);
    let compressed = run(
        "bf16",
        &bf16(WeightRounding::Stochastic),
        OptimizerHook::new(),
        8,
    );
    assert!(plain.dtypes.iter().all(|&dtype| dtype == DType::F32));
    assert!(
        compressed.dtypes.iter().all(|&dtype| dtype == DType::BF16),
        "{:?}",
        compressed.dtypes
    );
    // Every value is a bf16 value (the stored weights are the 16-bit ones, nothing wider).
    assert!(compressed
        .weights
        .iter()
        .all(|&w| f32::from_bits(w.to_bits() & 0xffff_0000) == w));
    // It trains as fp32 does: the same loss curve, to bf16's precision.
    let loss = |run: &Run| run.trace.last().unwrap().1.loss.unwrap();
    assert!(
        (loss(&plain) - loss(&compressed)).abs() < 0.05 * loss(&plain),
        "{} against {}",
        loss(&compressed),
        loss(&plain)
    );
    // Each step says what share of its updates left their weight unchanged.
    let shares: Vec<f64> = compressed
        .trace
        .iter()
        .filter_map(|(_, log)| log.weights_unchanged)
        .collect();
    assert_eq!(shares.len(), 8);
    assert!(shares.iter().all(|share| (0.0..1.0).contains(share)));
    assert!(plain
        .trace
        .iter()
        .all(|(_, log)| log.weights_unchanged.is_none()));
}

#[test]
fn each_rounding_is_read_and_the_seed_gives_the_same_draws() {
    let runs: Vec<Vec<f32>> = [
        WeightRounding::Stochastic,
        WeightRounding::Nearest,
        WeightRounding::Kahan,
    ]
    .into_iter()
    .map(|rounding| {
        run(
            &format!("{rounding}"),
            &bf16(rounding),
            OptimizerHook::new(),
            4,
        )
        .weights
    })
    .collect();
    assert_ne!(runs[0], runs[1]);
    assert_ne!(runs[1], runs[2]);
    assert_ne!(runs[0], runs[2]);
    let again = run(
        "again",
        &bf16(WeightRounding::Stochastic),
        OptimizerHook::new(),
        4,
    );
    assert_eq!(again.weights, runs[0]);
    let other_seed = bf16(WeightRounding::Stochastic)
        .with_weights(WeightSpec::new(WeightDtype::Bf16, WeightRounding::Stochastic).with_seed(6));
    let other = run("seed", &other_seed, OptimizerHook::new(), 4);
    assert_ne!(other.weights, runs[0]);
}

/// The step in backward steps each parameter as its gradient is final: with 16-bit weights,
/// the same draws and the same compensation, so the same bits as the ordinary step.
#[test]
fn the_step_in_backward_gives_the_ordinary_steps_bits() {
    let clip = || Some(GradClip::new(0.5, 2.0).unwrap());
    for (name, optimizer) in [
        ("sgd", sgd()),
        ("adamw", adam_w()),
        ("adam", OptimizerKind::adam()),
    ] {
        for rounding in [
            WeightRounding::Stochastic,
            WeightRounding::Nearest,
            WeightRounding::Kahan,
        ] {
            for state in [StateDtype::F32, StateDtype::Int8] {
                let spec = optimizer
                    .clone()
                    .with_state_dtype(state)
                    .with_weights(WeightSpec::new(WeightDtype::Bf16, rounding).with_seed(1));
                let label = format!("{name}-{rounding}-{state}");
                let after = run(&format!("{label}-after"), &spec, OptimizerHook::new(), 3);
                let within = run(
                    &format!("{label}-in"),
                    &spec,
                    OptimizerHook::new().with_step_in_backward(true),
                    3,
                );
                assert_eq!(after.weights, within.weights, "{label}");
            }
        }
        // Clipping (two passes) and accumulation (the group's sums).
        let spec = OptimizerSpec::from(optimizer).with_weights(WeightSpec::bf16().with_seed(2));
        let hooks = || {
            [
                OptimizerHook::new().with_grad_clip(clip()),
                GradientCumulativeOptimizerHook::new(2).unwrap(),
            ]
        };
        for (i, (plain, within)) in hooks().into_iter().zip(hooks()).enumerate() {
            let after = run(&format!("{name}-{i}-after"), &spec, plain, 4);
            let within = run(
                &format!("{name}-{i}-in"),
                &spec,
                within.with_step_in_backward(true),
                4,
            );
            assert_eq!(after.weights, within.weights, "{name} hook {i}");
        }
    }
}

/// Under `[fp16]`: bf16 weights with a bf16 forward run on the weights themselves; with an f16
/// forward, on an f16 copy of them. Both train, and the weights stay bf16.
#[test]
fn mixed_precision_runs_on_the_16_bit_weights() {
    let spec = bf16(WeightRounding::Stochastic);
    for precision in [Precision::Bf16, Precision::F16] {
        let hook = || {
            let scaler = LossScaler::new(512.0, ScaleMode::Dynamic, 2.0, 1000).unwrap();
            OptimizerHook::new().with_mixed_precision(scaler, precision)
        };
        let after = run(&format!("mixed-{precision}"), &spec, hook(), 4);
        assert!(after.dtypes.iter().all(|&dtype| dtype == DType::BF16));
        assert!(after.weights.iter().all(|w| w.is_finite()));
        let within = run(
            &format!("mixed-{precision}-in"),
            &spec,
            hook().with_step_in_backward(true),
            4,
        );
        assert_eq!(within.weights, after.weights, "{precision}");
    }
}

/// ZeRO: each peer steps its part of the parameters and sends the new 16-bit values; the
/// draws are keyed by the parameter's position and the step, so the peers hold plain data
/// parallelism's bits.
#[test]
fn zero_gives_plain_data_parallelisms_bits() {
    watchdog(300, || {
        let _turn = turn();
        for rounding in [WeightRounding::Stochastic, WeightRounding::Kahan] {
            let spec = spec(adam_w(), WeightDtype::Bf16, rounding);
            let runs: Vec<Vec<f32>> = [
                ZeroStage::Off,
                ZeroStage::OptimizerState,
                ZeroStage::Gradients,
            ]
            .into_iter()
            .map(|stage| {
                let peers = two_peers_of(
                    &format!("zero-{rounding}-{stage:?}"),
                    net,
                    |_, shard| data(2, 32, shard),
                    &spec,
                    stage,
                    OptimizerHook::new,
                    RunLength::Iters(4),
                );
                assert_eq!(peers[0].0, peers[1].0, "{rounding} {stage:?}");
                peers[0].0.clone()
            })
            .collect();
            assert_eq!(runs[0], runs[1], "{rounding}: ZeRO 1");
            assert_eq!(runs[0], runs[2], "{rounding}: ZeRO 2");
        }
    });
}

/// A run stopped and resumed from its snapshot ends with the uninterrupted run's bits: the
/// draws continue at the saved step, Kahan's compensation is restored.
#[test]
fn a_resumed_run_continues_exactly() {
    for rounding in [WeightRounding::Stochastic, WeightRounding::Kahan] {
        let spec = bf16(rounding);
        let whole = run(&format!("whole-{rounding}"), &spec, OptimizerHook::new(), 6);
        let dir = work_dir(&format!("halves-{rounding}"));
        run_in(&dir, &spec, OptimizerHook::new(), 3, Some(3), None);
        let resumed = run_in(
            &dir,
            &spec,
            OptimizerHook::new(),
            6,
            None,
            Some(&dir.join("latest.ckpt")),
        );
        assert_eq!(resumed.weights, whole.weights, "{rounding}");
        assert!(resumed.warnings.is_empty(), "{:?}", resumed.warnings);
    }
}

#[test]
fn snapshots_of_another_type_convert_with_a_notice_and_a_damaged_store_is_an_error() {
    // fp32 into bf16, and back: a notice naming both.
    let dir = work_dir("convert-fp32");
    run_in(&dir, &sgd().into(), OptimizerHook::new(), 2, Some(2), None);
    let into_bf16 = run_in(
        &dir,
        &bf16(WeightRounding::Stochastic),
        OptimizerHook::new(),
        3,
        None,
        Some(&dir.join("latest.ckpt")),
    );
    let notice = into_bf16.warnings.join("\n");
    assert!(
        notice.contains("holds fp32 weights") && notice.contains("bf16 (stochastic rounding)"),
        "{notice}"
    );
    assert!(into_bf16.dtypes.iter().all(|&dtype| dtype == DType::BF16));
    let dir = work_dir("convert-bf16");
    run_in(
        &dir,
        &bf16(WeightRounding::Kahan),
        OptimizerHook::new(),
        2,
        Some(2),
        None,
    );
    let into_fp32 = run_in(
        &dir,
        &sgd().into(),
        OptimizerHook::new(),
        3,
        None,
        Some(&dir.join("latest.ckpt")),
    );
    let notice = into_fp32.warnings.join("\n");
    assert!(
        notice.contains("holds bf16 (kahan rounding) weights") && notice.contains("in fp32"),
        "{notice}"
    );
    assert!(into_fp32.dtypes.iter().all(|&dtype| dtype == DType::F32));

    // The Kahan snapshot without its weights' section, then with a truncated one.
    let path = dir.join("latest.ckpt");
    let snapshot = Snapshot::load(&path).unwrap();
    for (case, weights) in [
        ("missing", None),
        (
            "truncated",
            Some(snapshot.weights.clone().unwrap()[..20].to_vec()),
        ),
    ] {
        let damaged = dir.join(format!("{case}.ckpt"));
        Snapshot {
            weights,
            ..snapshot.clone()
        }
        .save(&damaged)
        .unwrap();
        let mut runner = runner_with(
            net(),
            &bf16(WeightRounding::Kahan),
            Box::new(OptimizerHook::new()),
            data(4, 32, Shard::whole()),
            RunLength::Iters(4),
            &dir,
        );
        let error = runner.resume(&damaged).unwrap_err().to_string();
        assert!(error.contains(&format!("{case}.ckpt")), "{error}");
        assert!(
            error.contains(if case == "missing" {
                "is missing"
            } else {
                "truncated"
            }),
            "{error}"
        );
    }
}

/// f16 weights at a learning rate whose updates are below half their spacing: rounding to
/// nearest loses them, and the run says what share; stochastic rounding moves the weights.
#[test]
fn f16_weights_losing_their_updates_warn_with_the_share() {
    let tiny_lr = |rounding| {
        let dir = work_dir(&format!("f16-{rounding}"));
        let mut runner = memsave::train::Runner::new(
            net().map(&mut Seeded(9)),
            spec(sgd(), WeightDtype::F16, rounding),
            Box::new(OptimizerHook::new()),
            data(4, 32, Shard::whole()),
            RunLength::Iters(2),
            &dir,
            Default::default(),
        )
        .unwrap();
        runner.set_lr(1e-4).unwrap();
        runner.run().unwrap();
        let warnings = runner.state().warnings().to_vec();
        let share = runner
            .state()
            .weight_store()
            .and_then(|store| store.last_step())
            .unwrap()
            .fraction();
        (warnings, share)
    };
    let (warnings, share) = tiny_lr(WeightRounding::Nearest);
    assert!(share > 0.9, "{share}");
    let warning = warnings.join("\n");
    assert!(
        warning.contains("weight_dtype = \"f16\"")
            && warning.contains("% of the first step's updates were lost"),
        "{warning}"
    );
    let (_, share) = tiny_lr(WeightRounding::Stochastic);
    assert!(share < 0.999, "{share}");
}

/// A small ResNet classifier (memsave's layers) with its stem and first two stages frozen.
fn frozen_resnet() -> memsave::models::classifier::ImageClassifier<AB> {
    let config = memsave::models::resnet::ResNetConfig {
        depth: 18,
        base_channels: 8,
        frozen_stages: 2,
        ..Default::default()
    };
    /// Seeded values, the frozen parameters kept frozen.
    struct KeepFrozen(Seeded);
    impl burn::module::ModuleMapper<AB> for KeepFrozen {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<AB, D>>,
        ) -> Param<Tensor<AB, D>> {
            let trains = param.is_require_grad();
            let seeded = self.0.map_float(param);
            if trains {
                return seeded;
            }
            let (id, tensor, mapper) = seeded.consume();
            Param::from_mapped_value(id, tensor.set_require_grad(false), mapper)
        }
    }
    memsave::models::classifier::ImageClassifier::<AB>::new(&config, 4, &Default::default())
        .unwrap()
        .map(&mut KeepFrozen(Seeded(11)))
}

/// Frozen weights held in int8 (or bf16) per output channel, dequantized per layer: the run
/// trains, its forward within a few thousandths of fp32's, the frozen weights hand back their
/// dequantized values (within half a scale step of the originals, unchanged by training), a
/// snapshot resumes exactly; a model whose layers read a frozen weight with Burn's own `forward`
/// is an error naming it before anything trains.
#[test]
fn frozen_weights_are_held_in_int8_and_read_per_layer() {
    let frozen_values = |model: &memsave::models::classifier::ImageClassifier<AB>| {
        struct Frozen(Vec<f32>);
        impl ModuleVisitor<AB> for Frozen {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if D >= 2 && !param.is_require_grad() {
                    self.0.extend(common::values(param.val()));
                }
            }
        }
        let mut frozen = Frozen(Vec::new());
        model.visit(&mut frozen);
        frozen.0
    };
    let original = frozen_values(&frozen_resnet());
    let train = |name: &str, frozen: Option<memsave::nn::FrozenDtype>, iters, resume: bool| {
        let dir = work_dir(name);
        let spec = OptimizerSpec::from(sgd()).with_weights(WeightSpec::FP32.with_frozen(frozen));
        let make = |iters: usize, snapshot: bool| {
            let mut runner = runner_with(
                frozen_resnet(),
                &spec,
                Box::new(OptimizerHook::new()),
                class_data(),
                RunLength::Iters(iters),
                &dir,
            );
            if snapshot {
                runner.register_hook(Box::new(SnapshotHook::new(2, false)));
            }
            runner
        };
        if resume {
            make(2, true).run().unwrap();
            let mut runner = make(iters, false);
            runner.resume(&dir.join("latest.ckpt")).unwrap();
            let trace = Trace::default();
            runner.register_hook(Box::new(trace.clone()));
            runner.run().unwrap();
            let losses: Vec<f64> = trace.take().iter().map(|(_, l)| l.loss.unwrap()).collect();
            return (runner.into_model(), losses);
        }
        let mut runner = make(iters, false);
        let trace = Trace::default();
        runner.register_hook(Box::new(trace.clone()));
        runner.run().unwrap();
        let losses: Vec<f64> = trace.take().iter().map(|(_, l)| l.loss.unwrap()).collect();
        (runner.into_model(), losses)
    };
    let (plain, plain_losses) = train("frozen-fp32", None, 4, false);
    let (int8, int8_losses) = train(
        "frozen-int8",
        Some(memsave::nn::FrozenDtype::Int8),
        4,
        false,
    );
    // The first loss is the forward of the same weights: int8's moves it by little.
    let moved = ((int8_losses[0] - plain_losses[0]) / plain_losses[0]).abs();
    assert!(moved > 0.0 && moved < 5e-3, "{moved}");
    // The frozen weights come back dequantized: near the originals, the same as plain's.
    assert_eq!(frozen_values(&plain), original);
    let back = frozen_values(&int8);
    assert_eq!(back.len(), original.len());
    let worst = back
        .iter()
        .zip(&original)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst > 0.0 && worst < 0.3 / 127.0, "{worst}");
    // Resumed from a snapshot at iteration 2: the same run.
    let (resumed, resumed_losses) = train(
        "frozen-int8-resume",
        Some(memsave::nn::FrozenDtype::Int8),
        4,
        true,
    );
    assert_eq!(resumed_losses[..], int8_losses[2..]);
    assert_eq!(weights(&resumed), weights(&int8));
    // bf16: half the bytes, the same check.
    let (bf16, _) = train(
        "frozen-bf16",
        Some(memsave::nn::FrozenDtype::Bf16),
        2,
        false,
    );
    assert!(frozen_values(&bf16)
        .iter()
        .all(|&w| f32::from_bits(w.to_bits() & 0xffff_0000) == w));

    // The tiny net reads its frozen convolution with Burn's own `forward`.
    let mut tiny = net();
    tiny.conv.weight = tiny.conv.weight.set_require_grad(false);
    let spec = OptimizerSpec::from(sgd())
        .with_weights(WeightSpec::FP32.with_frozen(Some(memsave::nn::FrozenDtype::Int8)));
    let mut runner = runner_with(
        tiny,
        &spec,
        Box::new(OptimizerHook::new()),
        data(4, 32, Shard::whole()),
        RunLength::Iters(2),
        &work_dir("frozen-burn"),
    );
    let error = runner.run().unwrap_err().to_string();
    assert!(
        error.contains("optimizer.frozen_dtype") && error.contains("conv.weight"),
        "{error}"
    );
}

fn class_data() -> memsave::models::data::SyntheticClassification<AB> {
    let mut config = memsave::models::data::SyntheticClassificationConfig::new(4, 16, 32);
    config.seed = 3;
    memsave::models::data::SyntheticClassification::new(config, 4, Default::default()).unwrap()
}

/// How far frozen weights held compressed move a detector's forward: RetinaNet R50-FPN with
/// MMDetection's `frozen_stages = 1` (the stem and the first stage frozen), one 320 x 320 image,
/// its class logits and box deltas against fp32's: the largest difference over the largest
/// output, printed (docs/src/beyond-mmcv.md quotes it).
#[test]
fn frozen_int8_moves_a_detectors_outputs_by_little() {
    use memsave::models::detection::retinanet::RetinaNetConfig;
    let device = Default::default();
    let model = RetinaNetConfig::r50_fpn(20).init::<AB>(&device).unwrap();
    let image = Tensor::<AB, 4>::from_data(
        TensorData::new(
            (0..3 * 320 * 320)
                .map(|i: u64| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
                .collect::<Vec<f32>>(),
            [1, 3, 320, 320],
        ),
        &device,
    );
    let outputs = |model: &memsave::models::detection::retinanet::RetinaNet<AB>| -> Vec<f32> {
        let (levels, _) = model.forward(image.clone());
        levels
            .into_iter()
            .flat_map(|(cls, reg)| [common::values(cls), common::values(reg)])
            .flatten()
            .collect()
    };
    let plain = outputs(&model);
    let largest = plain.iter().fold(0f32, |m, v| m.max(v.abs()));
    for dtype in [
        memsave::nn::FrozenDtype::Int8,
        memsave::nn::FrozenDtype::Bf16,
    ] {
        let run = memsave::RunContext::named(format!("frozen {dtype}"));
        let moved = run
            .scope(|| {
                let (compressed, count, bytes) =
                    memsave::nn::frozen::compress_frozen(model.clone(), dtype);
                assert!(count > 0);
                let out = outputs(&compressed);
                let worst = out
                    .iter()
                    .zip(&plain)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                eprintln!(
                    "frozen {dtype}: {count} weights, {:.2} MiB held; outputs' largest \
                     difference {worst:.3e}, {:.3e} of the largest output",
                    bytes as f64 / (1 << 20) as f64,
                    worst / largest
                );
                worst / largest
            })
            .unwrap();
        assert!(moved > 0.0 && moved < 2e-2, "{dtype}: {moved}");
    }
}

/// The weights' bytes of ResNet-50 (the classifier, 4 classes): fp32 against bf16 weights as
/// the runner casts them, printed: 0.5x, and at most half a percent more for BatchNorm's
/// parameters, which stay fp32.
#[test]
fn resnet50s_weights_take_half_their_bytes_in_bf16() {
    use memsave::train::params::param_bytes;
    let config = memsave::models::resnet::ResNetConfig {
        depth: 50,
        ..Default::default()
    };
    let model =
        memsave::models::classifier::ImageClassifier::<AB>::new(&config, 4, &Default::default())
            .unwrap();
    let (fp32, _) = param_bytes::<AB, _>(&model);
    let bf16 = memsave::fp16::wrap_fp16_model(model, Precision::Bf16);
    let (half, _) = param_bytes::<AB, _>(&bf16);
    let ratio = half as f64 / fp32 as f64;
    eprintln!(
        "ResNet-50 weights: {:.1} MiB in fp32, {:.1} MiB in bf16: {ratio:.4}x",
        fp32 as f64 / (1 << 20) as f64,
        half as f64 / (1 << 20) as f64
    );
    assert!((0.5..0.505).contains(&ratio), "{ratio}");
}

/// ZeRO with Kahan rounding: each peer holds the compensations of its own parameters; a
/// snapshot gathers them all, and 2 peers resumed from it end with the uninterrupted run's bits.
#[test]
fn a_zero_snapshot_holds_every_peers_compensation_and_resumes_exactly() {
    watchdog(300, || {
        let _turn = turn();
        let spec = spec(adam_w(), WeightDtype::Bf16, WeightRounding::Kahan);
        let train = |dir: &Path, epochs: usize, resume: Option<&Path>| -> Vec<f32> {
            let resume = resume.map(Path::to_path_buf);
            let finals = peers(2, |peer| {
                let shard = peer.shard();
                let mut runner = peer_runner_with(
                    net(),
                    &spec,
                    ZeroStage::OptimizerState,
                    OptimizerHook::new(),
                    data(2, 16, shard),
                    RunLength::Epochs(epochs),
                    dir,
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
        };
        let dir = work_dir("zero-kahan");
        let whole = train(&dir.join("whole"), 4, None);
        let _ = train(&dir.join("half"), 2, None);
        let snapshot = dir.join("half").join("epoch_2.ckpt");
        let store = Snapshot::load(&snapshot).unwrap().weights.unwrap();
        // Every trainable parameter's compensation (the tiny net has four).
        let carries = u64::from_le_bytes(store[8..16].try_into().unwrap());
        assert_eq!(carries, 4);
        let resumed = train(&dir.join("resumed"), 4, Some(&snapshot));
        assert_eq!(resumed, whole);
    });
}
