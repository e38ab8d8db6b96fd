//! The runner and the optimizer hooks (REFERENCE.md sections 1 and 2): accumulation factors and
//! equivalence, fp16 with and without accumulation, overflow, exact resume, checkpoint files,
//! AMP end to end, anomalous parameters, global-norm clipping.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use common::tiny::TinyNet;
use common::AB;
use memsave::hooks::{
    Fp16OptimizerHook, GradClip, GradientCumulativeFp16OptimizerHook,
    GradientCumulativeOptimizerHook, LrSchedule, LrUpdaterHook, OptimizerHook,
};
use memsave::models::classifier::ClassificationBatch;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::grads::global_norm;
use memsave::train::snapshot::codec::record_bytes;
use memsave::train::snapshot::temporary_path;
use memsave::train::{
    DataSource, Hook, IterLog, OptimizerKind, RunLength, Runner, Snapshot as Checkpoint, TrainState,
};

type Net = TinyNet<AB>;
type Data = SyntheticClassification<AB>;

fn data(batch: usize, samples: usize) -> Data {
    let mut config = SyntheticClassificationConfig::new(batch, samples, 8);
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

/// The same start in every test and every run.
fn net() -> Net {
    TinyNet::new(4, false, &Default::default()).map(&mut common::tiny::Seeded(7))
}

/// A fresh temporary work directory.
fn work_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn runner<D: DataSource<AB, ClassificationBatch<AB>>>(
    model: Net,
    hook: Box<dyn Hook<AB, Net>>,
    data: D,
    length: RunLength,
    dir: &Path,
) -> Runner<AB, Net, D> {
    runner_with(model, &sgd(), 0.05, hook, data, length, dir)
}

/// A runner with this optimizer at this constant learning rate.
fn runner_with<D: DataSource<AB, ClassificationBatch<AB>>>(
    model: Net,
    optimizer: &OptimizerKind,
    lr: f64,
    hook: Box<dyn Hook<AB, Net>>,
    data: D,
    length: RunLength,
    dir: &Path,
) -> Runner<AB, Net, D> {
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
        schedule: LrSchedule::constant(lr),
    }));
    runner
}

/// Every parameter's values, in order.
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

/// Keeps each iteration's log.
struct Recorder(Arc<Mutex<Vec<IterLog>>>);

impl Hook<AB, Net> for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn after_iter(&mut self, state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        self.0.lock().unwrap().push(state.log.clone());
        Ok(())
    }
}

fn recorder() -> (Box<Recorder>, Arc<Mutex<Vec<IterLog>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    (Box::new(Recorder(log.clone())), log)
}

fn accumulate(c: usize) -> Box<OptimizerHook> {
    let mut hook = GradientCumulativeOptimizerHook::new(c).unwrap();
    hook.grad_clip = Some(GradClip::new(0.5, 2.0).unwrap());
    Box::new(hook)
}

fn plain() -> Box<OptimizerHook> {
    Box::new(OptimizerHook::new().with_grad_clip(Some(GradClip::new(0.5, 2.0).unwrap())))
}

// --- The step in groups of parameters --------------------------------------------------------

/// Sets the bytes per group of parameters the optimizer steps at once.
struct StepGroups(usize);

impl Hook<AB, Net> for StepGroups {
    fn name(&self) -> &'static str {
        "step_groups"
    }

    fn before_run(&mut self, state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        state.step_group_bytes = self.0;
        Ok(())
    }
}

#[test]
fn the_step_in_groups_of_parameters_equals_one_step_bit_for_bit() {
    let hooks: Vec<(&str, fn() -> Box<dyn Hook<AB, Net>>, OptimizerKind)> = vec![
        ("sgd", || plain(), sgd()),
        (
            "fp16",
            || {
                let scaler = LossScaler::new(512.0, ScaleMode::Static, 2.0, 1000).unwrap();
                let mut hook = Fp16OptimizerHook::new(scaler);
                hook.grad_clip = Some(GradClip::new(0.5, 2.0).unwrap());
                Box::new(hook)
            },
            sgd(),
        ),
        (
            "fp16_accumulation",
            || {
                let scaler = LossScaler::new(512.0, ScaleMode::Static, 2.0, 1000).unwrap();
                let mut hook = GradientCumulativeFp16OptimizerHook::new(2, scaler).unwrap();
                hook.grad_clip = Some(GradClip::new(0.5, 2.0).unwrap());
                Box::new(hook)
            },
            sgd(),
        ),
        (
            "adam",
            || plain(),
            OptimizerKind::Adam {
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 1e-4,
            },
        ),
    ];
    for (name, hook, optimizer) in hooks {
        let run = |group_bytes: usize| {
            let dir = work_dir(&format!("groups-{name}-{group_bytes}"));
            let mut runner = runner_with(
                net(),
                &optimizer,
                0.05,
                hook(),
                data(2, 8),
                RunLength::Iters(4),
                &dir,
            );
            runner.register_hook(Box::new(StepGroups(group_bytes)));
            let (recorder, log) = recorder();
            runner.register_hook(recorder);
            runner.run().unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            let groups: Vec<usize> = log.lock().unwrap().iter().map(|l| l.step_groups).collect();
            (weights(&runner.into_model()), groups)
        };
        // One byte: every parameter is a group of its own.
        let ((grouped, groups), (whole, one)) = (run(1), run(usize::MAX));
        // The setting is read: each parameter stepped alone, or all of them at once.
        assert!(
            groups.iter().all(|&n| n != 1) && groups.iter().any(|&n| n > 1),
            "{name}: {groups:?} groups per step"
        );
        assert!(
            one.iter().all(|&n| n <= 1) && one.contains(&1),
            "{name}: {one:?}"
        );
        assert_ne!(grouped, weights(&net()), "{name}: the weights moved");
        assert_eq!(grouped, whole, "{name}");
    }
}

// --- Accumulation ----------------------------------------------------------------------------

#[test]
fn loss_factors_are_mmcv_s() {
    let hook = GradientCumulativeOptimizerHook::new(3).unwrap();
    let factors = |start: usize, max: usize| -> Vec<usize> {
        (start..max)
            .map(|iter| hook.loss_factor(iter, max))
            .collect()
    };
    assert_eq!(factors(0, 6), vec![3; 6]);
    assert_eq!(factors(0, 8), vec![3, 3, 3, 3, 3, 3, 2, 2]);
    assert_eq!(factors(0, 10), vec![3, 3, 3, 3, 3, 3, 3, 3, 3, 1]);
    assert_eq!(factors(5, 10), vec![3, 3, 3, 3, 1]);
}

#[test]
fn zero_cumulative_iters_is_an_error_naming_the_key() {
    let error = GradientCumulativeOptimizerHook::new(0).unwrap_err();
    assert!(error.to_string().contains("cumulative_iters"), "{error}");
    assert!(GradientCumulativeFp16OptimizerHook::new(0, LossScaler::default()).is_err());
}

#[test]
fn steps_at_every_third_iteration_and_at_the_last_epoch_and_iteration_based() {
    for length in [RunLength::Epochs(2), RunLength::Iters(8)] {
        let dir = work_dir("steps");
        let mut runner = runner(net(), accumulate(3), data(1, 4), length, &dir);
        let (hook, log) = recorder();
        runner.register_hook(hook);
        runner.run().unwrap();
        let stepped: Vec<usize> = log
            .lock()
            .unwrap()
            .iter()
            .enumerate()
            .filter(|(_, log)| log.stepped)
            .map(|(iter, _)| iter)
            .collect();
        assert_eq!(stepped, vec![2, 5, 7], "{length:?}");
    }
}

fn assert_close(a: &[f32], b: &[f32], tolerance: f32) -> f32 {
    let difference = common::max_relative_difference(a, b);
    assert!(
        difference <= tolerance,
        "relative difference {difference} > {tolerance}"
    );
    difference
}

/// Trains the same start with batch 1 and accumulation 3 for `accumulated`, and with batch 3
/// for `batched`; returns the relative difference of the final weights.
fn accumulated_vs_batched(accumulated: RunLength, batched: RunLength, name: &str) -> f32 {
    let start = net();
    let dir = work_dir(name);
    let mut one = runner(start.clone(), accumulate(3), data(1, 12), accumulated, &dir);
    one.run().unwrap();
    let mut three = runner(start.clone(), plain(), data(3, 12), batched, &dir);
    three.run().unwrap();
    let (a, b) = (weights(&one.into_model()), weights(&three.into_model()));
    assert_ne!(a, weights(&start), "training moved the weights");
    assert_close(&a, &b, 1e-6)
}

#[test]
fn batch_1_with_accumulation_3_equals_batch_3_epoch_based() {
    let difference =
        accumulated_vs_batched(RunLength::Epochs(2), RunLength::Epochs(2), "acc-epoch");
    eprintln!("epoch-based: batch 1 x 3 vs batch 3, max relative difference {difference:e}");
}

#[test]
fn batch_1_with_accumulation_3_equals_batch_3_iteration_based() {
    // 18 and 6 iterations over 12 samples: both cross an epoch boundary at the same sample.
    let difference = accumulated_vs_batched(RunLength::Iters(18), RunLength::Iters(6), "acc-iter");
    eprintln!("iteration-based: batch 1 x 3 vs batch 3, max relative difference {difference:e}");
}

#[test]
fn the_fp16_accumulation_hook_equals_the_fp16_hook_at_batch_3() {
    let start = net();
    let dir = work_dir("acc-fp16");
    let scaler = LossScaler::fixed(512.0).unwrap();
    let hook = GradientCumulativeFp16OptimizerHook::new(3, scaler.clone()).unwrap();
    let mut accumulated = runner(
        start.clone(),
        Box::new(hook),
        data(1, 12),
        RunLength::Epochs(2),
        &dir,
    );
    accumulated.run().unwrap();
    let mut batched = runner(
        start.clone(),
        Box::new(Fp16OptimizerHook::new(scaler)),
        data(3, 12),
        RunLength::Epochs(2),
        &dir,
    );
    batched.run().unwrap();
    let (a, b) = (
        weights(&accumulated.into_model()),
        weights(&batched.into_model()),
    );
    assert_ne!(a, weights(&start));
    // Half precision rounds the three micro-batches differently from one batch of three.
    let difference = assert_close(&a, &b, 1e-2);
    eprintln!("fp16: batch 1 x 3 vs batch 3, max relative difference {difference:e}");
}

// --- Mixed precision -------------------------------------------------------------------------

/// Batches whose images at one iteration are `poison` (inf or NaN).
struct Poisoned {
    inner: Data,
    at: usize,
    poison: f32,
}

impl DataSource<AB, ClassificationBatch<AB>> for Poisoned {
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
        if epoch * self.batches_per_epoch() + index == self.at {
            batch.images = batch.images.mul_scalar(0.0).add_scalar(self.poison);
        }
        Ok(batch)
    }
}

/// Model record and optimizer state, as bytes.
type State = (Vec<u8>, Vec<u8>);

/// The weights and optimizer state before and after one iteration.
struct Snapshot {
    at: usize,
    taken: Arc<Mutex<Vec<State>>>,
}

impl Snapshot {
    fn take(&self, state: &TrainState<AB, Net>) {
        if state.iter == self.at {
            let model = record_bytes::<AB, _>(state.model.clone().into_record()).unwrap();
            let optimizer = state.optimizer.to_bytes().unwrap();
            self.taken.lock().unwrap().push((model, optimizer));
        }
    }
}

impl Hook<AB, Net> for Snapshot {
    fn name(&self) -> &'static str {
        "snapshot"
    }

    fn before_iter(&mut self, state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        self.take(state);
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        self.take(state);
        Ok(())
    }
}

#[test]
fn an_overflow_skips_the_step_bit_for_bit_and_halves_the_scale() {
    for poison in [f32::INFINITY, f32::NAN] {
        let dir = work_dir("overflow");
        let scaler = LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 1000).unwrap();
        let source = Poisoned {
            inner: data(4, 16),
            at: 2,
            poison,
        };
        let mut runner = runner(
            net(),
            Box::new(Fp16OptimizerHook::new(scaler)),
            source,
            RunLength::Iters(4),
            &dir,
        );
        let taken = Arc::new(Mutex::new(Vec::new()));
        runner.register_hook(Box::new(Snapshot {
            at: 2,
            taken: taken.clone(),
        }));
        let (hook, log) = recorder();
        runner.register_hook(hook);
        runner.run().unwrap();

        let taken = taken.lock().unwrap();
        assert_eq!(taken.len(), 2);
        assert!(taken[0].0 == taken[1].0, "{poison}: the weights changed");
        assert!(
            taken[0].1 == taken[1].1,
            "{poison}: the optimizer state changed"
        );
        let log = log.lock().unwrap();
        assert!(
            log[1].stepped && !log[2].stepped && log[3].stepped,
            "{poison}"
        );
        assert_eq!(log[1].loss_scale, Some(1024.0));
        assert_eq!(
            log[2].loss_scale,
            Some(512.0),
            "{poison}: the scale backs off"
        );
        let warning = runner.state().warnings().join("\n");
        assert!(
            warning.contains("overflow") && warning.contains("512"),
            "{warning}"
        );
    }
}

#[test]
fn a_first_step_overflowing_at_mmcvs_scale_says_once_how_to_start_lower() {
    let dir = work_dir("first-overflow");
    let source = Poisoned {
        inner: data(4, 16),
        at: 0,
        poison: f32::INFINITY,
    };
    let mut runner = runner(
        net(),
        Box::new(Fp16OptimizerHook::new(LossScaler::default())),
        source,
        RunLength::Iters(3),
        &dir,
    );
    runner.run().unwrap();
    let warnings = runner.state().warnings();
    let advice: Vec<_> = warnings
        .iter()
        .filter(|w| w.contains("init_scale = 65536.0"))
        .collect();
    assert_eq!(advice.len(), 1, "{warnings:#?}");
    assert!(advice[0].contains("16 more overflows"), "{}", advice[0]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_already_wrapped_for_half_precision_is_an_error_naming_it() {
    let dir = work_dir("wrapped");
    let wrapped = memsave::fp16::wrap_fp16_model(net(), memsave::fp16::Precision::F16);
    let mut runner = runner(
        wrapped,
        Box::new(Fp16OptimizerHook::new(LossScaler::fixed(512.0).unwrap())),
        data(4, 16),
        RunLength::Iters(2),
        &dir,
    );
    let error = runner.run().unwrap_err().to_string();
    assert!(
        error.contains("model") && error.contains("wrap_fp16_model") && error.contains("fp32"),
        "{error}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_run_without_a_learning_rate_stops_before_its_first_step_naming_lr() {
    let dir = work_dir("no-lr");
    let start = net();
    let fresh = || {
        Runner::new(
            start.clone(),
            &sgd(),
            Box::new(OptimizerHook::new()),
            data(4, 16),
            RunLength::Iters(2),
            &dir,
            Default::default(),
        )
        .unwrap()
    };
    let mut runner = fresh();
    let error = runner.run().unwrap_err().to_string();
    assert!(error.contains("lr") && error.contains("set_lr"), "{error}");
    assert_eq!(runner.state().iter, 0, "no step was taken");
    assert!(weights(&runner.into_model()) == weights(&start));

    // `set_lr` is read: at 0 nothing moves, at 0.1 the weights do.
    let trained = |lr: f64| {
        let mut runner = fresh();
        runner.set_lr(lr).unwrap();
        runner.run().unwrap();
        weights(&runner.into_model())
    };
    assert!(trained(0.0) == weights(&start));
    assert!(trained(0.1) != weights(&start));
    let error = fresh().set_lr(-1.0).unwrap_err().to_string();
    assert!(error.contains("lr"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn optimizer_constructors_have_pytorchs_defaults_and_bad_values_are_errors() {
    assert_eq!(
        OptimizerKind::adam(),
        OptimizerKind::Adam {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0
        }
    );
    assert_eq!(
        OptimizerKind::adamw(),
        OptimizerKind::AdamW {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01
        }
    );
    assert_eq!(OptimizerKind::sgd(0.9).with_weight_decay(1e-4), sgd());
    let dir = work_dir("bad-optimizer");
    for (kind, key) in [
        (OptimizerKind::sgd(-0.9), "momentum"),
        (OptimizerKind::nesterov(0.0), "nesterov"),
        (
            OptimizerKind::adam().with_weight_decay(f64::NAN),
            "weight_decay",
        ),
        (
            OptimizerKind::Adam {
                betas: (0.9, 1.0),
                eps: 1e-8,
                weight_decay: 0.0,
            },
            "betas",
        ),
    ] {
        let error = Runner::new(
            net(),
            &kind,
            Box::new(OptimizerHook::new()),
            data(4, 16),
            RunLength::Iters(1),
            &dir,
            Default::default(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(error.contains(key), "{kind:?}: {error}");
    }
}

#[test]
fn amp_end_to_end_reaches_the_fp32_loss_within_5_percent() {
    let start = net();
    let mean_tail = |hook: Box<dyn Hook<AB, Net>>| {
        let dir = work_dir("amp");
        let config = SyntheticClassificationConfig::new(8, 64, 8);
        let source = SyntheticClassification::new(config, 4, Default::default()).unwrap();
        let mut runner = runner_with(
            start.clone(),
            &sgd(),
            0.5,
            hook,
            source,
            RunLength::Iters(50),
            &dir,
        );
        let (recorder, log) = recorder();
        runner.register_hook(recorder);
        runner.run().unwrap();
        let log = log.lock().unwrap();
        let tail: Vec<f64> = log[40..].iter().map(|l| l.loss.unwrap()).collect();
        (
            tail.iter().sum::<f64>() / tail.len() as f64,
            log[0].loss.unwrap(),
        )
    };
    let (fp32, first) = mean_tail(Box::<OptimizerHook>::default());
    let (fp16, _) = mean_tail(Box::new(Fp16OptimizerHook::new(
        LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2000).unwrap(),
    )));
    eprintln!(
        "AMP: mean loss of steps 41-50: fp32 {fp32:.4}, f16 {fp16:.4} (first step {first:.4})"
    );
    assert!(
        fp32 < first * 0.9,
        "the fp32 run learned ({first} -> {fp32})"
    );
    assert!(
        (fp16 - fp32).abs() <= 0.05 * fp32,
        "fp16 {fp16} vs fp32 {fp32}"
    );
}

// --- Resume and checkpoint files -------------------------------------------------------------

fn checkpointed_run(dir: &Path, hook: Box<dyn Hook<AB, Net>>, model: Net) -> Runner<AB, Net, Data> {
    let mut runner = runner(model, hook, data(2, 8), RunLength::Iters(12), dir);
    runner.register_hook(Box::new(memsave::hooks::SnapshotHook::new(3, false)));
    runner
}

#[test]
fn resuming_at_a_group_boundary_ends_with_exactly_the_uninterrupted_weights() {
    let dir = work_dir("resume");
    let mut uninterrupted = checkpointed_run(&dir, accumulate(2), net());
    uninterrupted.run().unwrap();
    let expected = weights(&uninterrupted.into_model());
    assert!(dir.join("iter_6.ckpt").exists() && dir.join("latest.ckpt").exists());

    // Another start: the weights must come from the checkpoint.
    let mut resumed = checkpointed_run(&dir.join("resumed"), accumulate(2), net());
    resumed.resume(&dir.join("iter_6.ckpt")).unwrap();
    assert_eq!(resumed.state().iter, 6);
    resumed.run().unwrap();
    assert!(resumed.state().warnings().is_empty());
    assert_eq!(weights(&resumed.into_model()), expected, "bit-identical");
}

#[test]
fn resuming_inside_a_group_warns() {
    let dir = work_dir("resume-inside");
    let mut first = checkpointed_run(&dir, accumulate(2), net());
    first.run().unwrap();
    let mut resumed = checkpointed_run(&dir.join("resumed"), accumulate(2), net());
    resumed.resume(&dir.join("iter_3.ckpt")).unwrap();
    resumed.run().unwrap();
    let warnings = resumed.state().warnings().join("\n");
    assert!(
        warnings.contains("not a multiple of cumulative_iters"),
        "{warnings}"
    );
}

#[test]
fn resuming_mixed_precision_restores_the_loss_scale_and_the_weights() {
    let dir = work_dir("resume-fp16");
    let hook = || {
        Box::new(Fp16OptimizerHook::new(
            LossScaler::new(1e6, ScaleMode::Dynamic, 2.0, 2).unwrap(),
        ))
    };
    let mut uninterrupted = checkpointed_run(&dir, hook(), net());
    uninterrupted.run().unwrap();
    let expected = weights(&uninterrupted.into_model());
    let mut resumed = checkpointed_run(&dir.join("resumed"), hook(), net());
    resumed.resume(&dir.join("iter_6.ckpt")).unwrap();
    resumed.run().unwrap();
    assert_eq!(weights(&resumed.into_model()), expected);
}

/// The snapshots kept for the two runtimes' readers (issue 55, item 7): one written by this
/// runner on Burn 0.21 (fp16 with a dynamic scale, SGD with momentum, iteration 3), and one
/// written by memsave on Burn 0.22 (`next/tests/suite/snapshot.rs` writes and reads it).
/// `MEMSAVE_WRITE_FIXTURES=1` writes this runner's again.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/snapshots")
        .join(name)
}

#[test]
fn the_kept_0_21_snapshot_resumes_here_and_a_0_22_one_is_refused_naming_its_version() {
    let hook = || {
        Box::new(Fp16OptimizerHook::new(
            LossScaler::new(1e6, ScaleMode::Dynamic, 2.0, 2).unwrap(),
        ))
    };
    let kept = fixture("written-on-burn-0.21.ckpt");
    if std::env::var_os("MEMSAVE_WRITE_FIXTURES").is_some() {
        let dir = work_dir("fixture-0.21");
        checkpointed_run(&dir, hook(), net()).run().unwrap();
        std::fs::create_dir_all(kept.parent().unwrap()).unwrap();
        std::fs::copy(dir.join("iter_3.ckpt"), &kept).unwrap();
    }
    // A snapshot of this format, as this runner writes them: it resumes at its iteration.
    let mut resumed = checkpointed_run(&work_dir("fixture-0.21-resumed"), hook(), net());
    resumed.resume(&kept).unwrap();
    assert_eq!(resumed.state().iter, 3);
    assert_eq!(
        Checkpoint::load(&kept).unwrap().meta.memsave_version,
        "0.1.0"
    );

    // One written on Burn 0.22: refused, naming the file, the version and what to do.
    let newer = fixture("written-on-burn-0.22.ckpt");
    let error = checkpointed_run(&work_dir("fixture-0.22"), hook(), net())
        .resume(&newer)
        .unwrap_err()
        .to_string();
    for part in [
        "written-on-burn-0.22.ckpt",
        "by memsave 0.1.0 on Burn 0.22",
        "runs on Burn 0.21",
        "resume this run with the memsave on Burn 0.22",
    ] {
        assert!(error.contains(part), "{part:?} in {error}");
    }
}

#[test]
fn resuming_across_precisions_warns_naming_both() {
    let dir = work_dir("resume-precision");
    let fp16 = || {
        Box::new(Fp16OptimizerHook::new(
            LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 2).unwrap(),
        ))
    };
    let mut first = checkpointed_run(&dir, fp16(), net());
    first.run().unwrap();

    // An f16 checkpoint under an fp32 run.
    let mut resumed = checkpointed_run(&dir.join("fp32"), plain(), net());
    resumed.resume(&dir.join("iter_6.ckpt")).unwrap();
    let warnings = resumed.state().warnings().join("\n");
    assert!(
        warnings.contains("trained in f16, and this config trains in fp32")
            && warnings.contains("iter_6.ckpt"),
        "{warnings}"
    );
    resumed.run().unwrap();

    // And the reverse: fp32 checkpoint, f16 run.
    let mut resumed = checkpointed_run(&dir.join("f16"), fp16(), net());
    resumed
        .resume(&dir.join("fp32").join("iter_9.ckpt"))
        .unwrap();
    let warnings = resumed.state().warnings().join("\n");
    assert!(
        warnings.contains("trained in fp32, and this config trains in f16"),
        "{warnings}"
    );

    // The same precision: no warning.
    let mut same = checkpointed_run(&dir.join("same"), fp16(), net());
    same.resume(&dir.join("iter_6.ckpt")).unwrap();
    assert!(same.state().warnings().is_empty());
}

#[test]
fn resuming_adam_and_adamw_is_exact_and_the_accumulation_position_is_saved() {
    for optimizer in [
        OptimizerKind::Adam {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-4,
        },
        OptimizerKind::AdamW {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
        },
    ] {
        let dir = work_dir("resume-adam");
        let run = |dir: &Path| {
            let mut runner = runner_with(
                net(),
                &optimizer,
                0.01,
                accumulate(2),
                data(2, 8),
                RunLength::Iters(10),
                dir,
            );
            runner.register_hook(Box::new(memsave::hooks::SnapshotHook::new(3, false)));
            runner
        };
        let mut uninterrupted = run(&dir);
        uninterrupted.run().unwrap();
        let expected = weights(&uninterrupted.into_model());
        let mut resumed = run(&dir.join("resumed"));
        resumed.resume(&dir.join("iter_6.ckpt")).unwrap();
        resumed.run().unwrap();
        assert_eq!(weights(&resumed.into_model()), expected, "{optimizer:?}");

        // iter_3: one micro-batch of the second group was summed but not stepped.
        let meta = Checkpoint::load(&dir.join("iter_3.ckpt")).unwrap().meta;
        assert_eq!(meta.iter, 3);
        assert_eq!(meta.hooks["cumulative"]["pending"], 1);
        assert_eq!(meta.hooks["cumulative"]["cumulative_iters"], 2);
    }
}

#[test]
fn an_interrupted_write_leaves_the_previous_checkpoint_loadable() {
    let dir = work_dir("interrupted");
    let mut run = checkpointed_run(&dir, plain(), net());
    run.run().unwrap();
    let path = dir.join("latest.ckpt");
    let before = Checkpoint::load(&path).unwrap();
    // A crash half-way through the next write leaves a half-written temporary file.
    let newer = std::fs::read(dir.join("iter_3.ckpt")).unwrap();
    std::fs::write(temporary_path(&path), &newer[..newer.len() / 2]).unwrap();
    assert_eq!(Checkpoint::load(&path).unwrap(), before);
    let mut resumed = checkpointed_run(&dir.join("resumed"), plain(), net());
    resumed.resume(&path).unwrap();
    assert_eq!(resumed.state().iter, 12);
}

#[test]
fn bad_checkpoints_are_errors_naming_the_file_never_panics() {
    let dir = work_dir("bad");
    let mut run = checkpointed_run(&dir, plain(), net());
    run.run().unwrap();
    let good = std::fs::read(dir.join("iter_6.ckpt")).unwrap();

    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated.ckpt",
            good[..good.len() * 2 / 3].to_vec(),
            "checksum",
        ),
        (
            "flipped.ckpt",
            {
                let mut bytes = good.clone();
                let middle = bytes.len() / 2;
                bytes[middle] ^= 0xff;
                bytes
            },
            "checksum",
        ),
        (
            "text.ckpt",
            b"not a checkpoint at all".to_vec(),
            "not a memsave checkpoint",
        ),
        ("empty.ckpt", Vec::new(), "not a memsave checkpoint"),
    ];
    for (name, bytes, expected) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let mut resumed = checkpointed_run(&dir.join("resumed"), plain(), net());
        let error = resumed.resume(&path).unwrap_err().to_string();
        assert!(
            error.contains(name) && error.contains(expected),
            "{name}: {error}"
        );
    }
    let missing = dir.join("missing.ckpt");
    let error = checkpointed_run(&dir, plain(), net())
        .resume(&missing)
        .unwrap_err();
    assert!(error.to_string().contains("missing.ckpt"), "{error}");

    // A checkpoint of another model: five classes instead of four.
    let other = TinyNet::<AB>::new(5, false, &Default::default());
    let mut resumed = Runner::new(
        other,
        &sgd(),
        plain(),
        data(2, 8),
        RunLength::Iters(12),
        dir.join("other"),
        Default::default(),
    )
    .unwrap();
    let error = resumed
        .resume(&dir.join("iter_6.ckpt"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("another model"), "{error}");
}

// --- Anomalous parameters and clipping -------------------------------------------------------

#[test]
fn parameters_without_gradient_are_reported_by_path() {
    let dir = work_dir("anomalous");
    let hook = OptimizerHook::new().with_detect_anomalous_params(true);
    let model = TinyNet::<AB>::new(4, true, &Default::default());
    let mut runner = runner(model, Box::new(hook), data(2, 4), RunLength::Iters(1), &dir);
    runner.run().unwrap();
    let warnings = runner.state().warnings().join("\n");
    assert!(warnings.contains("spare"), "{warnings}");
    assert!(!warnings.contains("conv"), "{warnings}");
}

#[test]
fn global_norm_matches_a_hand_computation() {
    let model = net();
    let mut grads = GradientsParams::new();
    // conv.weight [8, 3, 3, 3] all 0.5; fc.weight [8, 4] all 1.0; biases without gradient.
    let device = Default::default();
    grads.register::<burn::backend::Flex, 4>(
        model.conv.weight.id,
        Tensor::full([8, 3, 3, 3], 0.5, &device),
    );
    grads.register::<burn::backend::Flex, 2>(
        model.fc.weight.id,
        Tensor::full([8, 4], -1.0, &device),
    );
    let (n1, n2) = (216.0_f64, 32.0_f64);
    let two = global_norm::<AB, Net>(&model, &grads, 2.0).unwrap();
    assert!((two - (n1 * 0.25 + n2).sqrt()).abs() < 1e-4, "{two}");
    let one = global_norm::<AB, Net>(&model, &grads, 1.0).unwrap();
    assert!((one - (n1 * 0.5 + n2)).abs() < 1e-3, "{one}");
    let inf = global_norm::<AB, Net>(&model, &grads, f64::INFINITY).unwrap();
    assert_eq!(inf, 1.0);
}

#[test]
fn clipping_scales_every_gradient_by_max_norm_over_the_global_norm() {
    // One step of plain SGD (lr 1) with and without clipping: the update shrinks by the ratio.
    let start = net();
    let dir = work_dir("clip");
    let step = |clip: Option<GradClip>| {
        let hook = OptimizerHook::new().with_grad_clip(clip);
        let mut runner = runner_with(
            start.clone(),
            &OptimizerKind::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
            },
            1.0,
            Box::new(hook),
            data(4, 4),
            RunLength::Iters(1),
            &dir,
        );
        let (recorder, log) = recorder();
        runner.register_hook(recorder);
        runner.run().unwrap();
        let norm = log.lock().unwrap()[0].grad_norm.unwrap();
        (weights(&runner.into_model()), norm)
    };
    let before = weights(&start);
    let (free, norm) = step(None);
    let max_norm = norm / 4.0;
    let (clipped, _) = step(Some(GradClip::new(max_norm, 2.0).unwrap()));
    let ratio = max_norm / (norm + 1e-6);
    for ((b, f), c) in before.iter().zip(&free).zip(&clipped) {
        let expected = b + (f - b) * ratio as f32;
        assert!(
            (c - expected).abs() <= 1e-6 + 1e-5 * expected.abs(),
            "{c} vs {expected}"
        );
    }
}

#[test]
fn resuming_from_an_edited_loss_scaler_state_is_an_error_naming_the_file_and_field() {
    let dir = work_dir("resume-bad-scaler");
    let hook = || {
        Box::new(Fp16OptimizerHook::new(
            LossScaler::new(1e6, ScaleMode::Dynamic, 2.0, 2).unwrap(),
        ))
    };
    let mut run = checkpointed_run(&dir, hook(), net());
    run.run().unwrap();
    // A dynamic state with a zero window (an edited or foreign checkpoint, CRC made valid).
    let path = dir.join("iter_6.ckpt");
    let mut checkpoint = Checkpoint::load(&path).unwrap();
    checkpoint.meta.hooks.get_mut("fp16").unwrap()["scale_window"] = 0.into();
    let edited = dir.join("edited.ckpt");
    checkpoint.save(&edited).unwrap();
    let mut resumed = checkpointed_run(&dir.join("resumed"), hook(), net());
    let message = resumed.resume(&edited).unwrap_err().to_string();
    assert!(
        message.contains("edited.ckpt") && message.contains("scale_window"),
        "{message}"
    );
}

/// Panics at one iteration as CubeCL's CUDA allocator does when the device is full.
struct DeviceFull {
    at: usize,
}

impl Hook<AB, Net> for DeviceFull {
    fn name(&self) -> &'static str {
        "device_full"
    }

    fn after_iter(&mut self, state: &mut TrainState<AB, Net>) -> memsave::Result<()> {
        if state.iter == self.at {
            panic!("can't allocate buffer of size: 1073741824\nBacktrace\n(captured)");
        }
        Ok(())
    }
}

#[test]
fn a_device_out_of_memory_at_a_step_ends_the_run_with_an_error_and_keeps_the_checkpoints() {
    let _panics = common::panicking_steps();
    let dir = work_dir("device-full");
    let mut run = checkpointed_run(&dir, plain(), net());
    run.register_hook(Box::new(DeviceFull { at: 4 }));
    let error = run.run().unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(
            error,
            memsave::Error::OutOfMemory {
                needed: 1073741824,
                ..
            }
        ),
        "{message}"
    );
    assert!(
        message.contains("iteration 4") && message.contains("1.0 GiB"),
        "{message}"
    );
    assert!(message.contains("checkpointing"), "advice: {message}");
    // The checkpoint written before (after iteration 3) is whole; nothing after it.
    let saved = Checkpoint::load(&dir.join("iter_3.ckpt")).unwrap();
    assert_eq!(saved.meta.iter, 3);
    assert_eq!(
        Checkpoint::load(&dir.join("latest.ckpt"))
            .unwrap()
            .meta
            .iter,
        3
    );
    assert!(!dir.join("iter_6.ckpt").exists());
}

#[test]
fn any_other_panic_in_a_step_is_not_taken_for_out_of_memory() {
    let _panics = common::panicking_steps();
    struct Broken;
    impl Hook<AB, Net> for Broken {
        fn name(&self) -> &'static str {
            "broken"
        }
        fn after_iter(&mut self, _: &mut TrainState<AB, Net>) -> memsave::Result<()> {
            panic!("index out of bounds");
        }
    }
    let dir = work_dir("broken-hook");
    let mut run = checkpointed_run(&dir, plain(), net());
    run.register_hook(Box::new(Broken));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run.run()));
    assert!(outcome.is_err(), "the panic goes on");
}

#[test]
fn max_keep_ckpts_keeps_the_newest_snapshots_and_latest_names_the_last() {
    let dir = work_dir("max-keep");
    let mut runner = runner(net(), plain(), data(2, 8), RunLength::Iters(12), &dir);
    let mut hook = memsave::hooks::SnapshotHook::new(3, false);
    hook.max_keep = Some(2);
    runner.register_hook(Box::new(hook));
    runner.run().unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".ckpt"))
        .collect();
    names.sort();
    assert_eq!(names, ["iter_12.ckpt", "iter_9.ckpt", "latest.ckpt"]);
    let latest = Checkpoint::load(&dir.join("latest.ckpt")).unwrap();
    assert_eq!(latest.meta.iter, 12);
    assert_eq!(latest, Checkpoint::load(&dir.join("iter_12.ckpt")).unwrap());
}
