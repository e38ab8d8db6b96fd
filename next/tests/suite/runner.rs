//! MMCV's runner on Burn 0.22 (`memsave_next::train::Runner` with `memsave_next::hooks`): the
//! loop and its hooks train the weights a hand-written loop trains, bit for bit: fp32 under a
//! learning-rate schedule, accumulation with MMCV's loss factor (the final partial group too),
//! mixed precision against `MixedPrecision`'s user loop, an overflow skipped, 16-bit weights; a
//! run resumed from its own snapshot continues bit for bit; hooks run in MMCV's order; the log;
//! and the errors a user can meet.

use std::sync::{Arc, Mutex};

use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;
use memsave_next::amp::MixedPrecision;
use memsave_next::fp16::{wrap_fp16_model, Precision};
use memsave_next::grads;
use memsave_next::hooks::{
    Fp16OptimizerHook, GradientCumulativeFp16OptimizerHook, GradientCumulativeOptimizerHook,
    LoggerHook, LrSchedule, LrUpdaterHook, OptimizerHook, Policy, SnapshotHook, Warmup,
};
use memsave_next::scaler::{LossScaler, ScaleMode};
use memsave_next::snapshot::Snapshot;
use memsave_next::train::{
    DataSource, Hook, IterLog, Priority, RunLength, Runner, TrainModel, TrainState,
};
use memsave_next::weights16::Weights16;
use memsave_next::Error;

use crate::common;
use common::mlp::{batch, Mlp};
use common::{device, initialized, param_bits, watchdog};

type Batch = (Tensor<2>, Tensor<2>);

/// Four batches an epoch of `rows` rows, each a pattern of its own; `scale` times larger at
/// the iterations listed in `loud` (to overflow f16).
#[derive(Clone)]
struct Data {
    rows: usize,
    loud: Vec<usize>,
}

impl Data {
    fn new(rows: usize) -> Self {
        Data {
            rows,
            loud: Vec::new(),
        }
    }

    fn at(&self, iter: usize, device: &Device) -> Batch {
        let scale = if self.loud.contains(&iter) {
            100.0
        } else {
            1.0
        };
        batch(
            device,
            self.rows,
            [6, 3],
            [iter % 4 * 7, iter % 4 + 11],
            scale,
        )
    }

    /// Iterations `iters` as one batch (their rows one after the other).
    fn joined(&self, iters: std::ops::Range<usize>, device: &Device) -> Batch {
        let (xs, ys): (Vec<_>, Vec<_>) = iters.map(|iter| self.at(iter, device)).unzip();
        (Tensor::cat(xs, 0), Tensor::cat(ys, 0))
    }
}

impl DataSource<Batch> for Data {
    fn batches_per_epoch(&self) -> usize {
        4
    }

    fn batch(&self, epoch: usize, index: usize, device: &Device) -> memsave_next::Result<Batch> {
        Ok(self.at(epoch * 4 + index, device))
    }
}

fn mlp(seed: u64) -> Mlp {
    device().seed(seed);
    initialized(Mlp::new(&device(), [6, 16, 3]))
}

/// SGD with PyTorch's usual momentum of 0.9.
fn momentum() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

fn work_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("memsave-next-runner-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn runner(
    model: Mlp,
    optimizer: ModuleOptimizer,
    hook: OptimizerHook,
    data: Data,
    length: RunLength,
    dir: &std::path::Path,
) -> Runner<Mlp, Data> {
    Runner::new(
        model,
        optimizer,
        Box::new(hook),
        data,
        length,
        dir,
        device(),
    )
    .unwrap()
}

/// Records each iteration's learning rate and log after the optimizer hook.
#[derive(Clone, Default)]
struct Probe(Arc<Mutex<Vec<(f64, IterLog)>>>);

impl Hook<Mlp> for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn after_iter(&mut self, state: &mut TrainState<Mlp>) -> memsave_next::Result<()> {
        self.0.lock().unwrap().push((state.lr, state.log.clone()));
        Ok(())
    }
}

impl Probe {
    fn seen(&self) -> Vec<(f64, IterLog)> {
        self.0.lock().unwrap().clone()
    }
}

#[test]
fn fp32_under_a_schedule_trains_the_hand_written_loops_weights_bit_for_bit() {
    watchdog(300, || {
        let schedule = LrSchedule {
            base_lr: 0.05,
            policy: Policy::Step,
            step: vec![5],
            gamma: 0.1,
            by_epoch: Some(false),
            warmup: Some(Warmup::Linear),
            warmup_iters: 3,
            warmup_ratio: 0.2,
        };
        let data = Data::new(8);
        let dir = work_dir("schedule");
        let mut run = runner(
            mlp(1),
            momentum(),
            OptimizerHook::new(),
            data.clone(),
            RunLength::Epochs(2),
            &dir,
        );
        run.register_hook_at(
            Box::new(LrUpdaterHook::new(schedule.clone()).unwrap()),
            Priority::VeryHigh,
        );
        let probe = Probe::default();
        run.register_hook(Box::new(probe.clone()));
        run.run().unwrap();
        let seen = probe.seen();
        assert_eq!(seen.len(), 8);
        for (iter, (lr, log)) in seen.iter().enumerate() {
            assert_eq!(
                *lr,
                schedule.lr_at(iter, iter / 4),
                "iteration {iter}'s rate"
            );
            assert!(
                log.stepped && log.loss.is_some() && log.grad_norm.is_some(),
                "{log:?}"
            );
        }

        let mut model = mlp(1);
        let mut optimizer = momentum();
        for iter in 0..8 {
            let (x, y) = data.at(iter, &device());
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optimizer.step(schedule.lr_at(iter, iter / 4), model, grads);
        }
        let trained = run.into_model();
        assert_eq!(param_bits(&trained), param_bits(&model));
        // The schedule is read: at a constant base rate the weights differ.
        let mut constant = runner(
            mlp(1),
            momentum(),
            OptimizerHook::new(),
            data,
            RunLength::Epochs(2),
            &dir,
        );
        constant.set_lr(0.05).unwrap();
        constant.run().unwrap();
        assert_ne!(param_bits(&constant.into_model()), param_bits(&model));
    });
}

#[test]
fn accumulation_steps_on_the_mean_of_its_group_the_last_partial_group_too() {
    watchdog(300, || {
        // Six micro-batches in groups of four: a group of 4, then the final partial one of 2,
        // whose losses MMCV divides by 2.
        let data = Data::new(8);
        let dir = work_dir("accumulation");
        let mut run = runner(
            mlp(2),
            SgdConfig::new().init(),
            GradientCumulativeOptimizerHook::new(4).unwrap(),
            data.clone(),
            RunLength::Iters(6),
            &dir,
        );
        run.set_lr(0.1).unwrap();
        let probe = Probe::default();
        run.register_hook(Box::new(probe.clone()));
        run.run().unwrap();
        let stepped: Vec<bool> = probe.seen().iter().map(|(_, log)| log.stepped).collect();
        assert_eq!(stepped, [false, false, false, true, false, true]);
        let grouped = param_bits(&run.into_model());

        // The same steps on the groups joined into one batch (the mean over its rows).
        let mut model = mlp(2);
        let mut optimizer = SgdConfig::new().init();
        for group in [0..4, 4..6] {
            let (x, y) = data.joined(group, &device());
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optimizer.step(0.1, model, grads);
        }
        common::assert_close(
            &param_bits(&model).into_iter().map(Some).collect::<Vec<_>>(),
            &grouped.iter().cloned().map(Some).collect::<Vec<_>>(),
            1e-5,
            "accumulated against the joined batch",
        );
        // The groups are read: stepping every micro-batch gives other weights.
        let mut every = runner(
            mlp(2),
            SgdConfig::new().init(),
            OptimizerHook::new(),
            data,
            RunLength::Iters(6),
            &dir,
        );
        every.set_lr(0.1).unwrap();
        every.run().unwrap();
        assert_ne!(param_bits(&every.into_model()), grouped);
    });
}

#[test]
fn mixed_precision_is_the_user_loops_mixed_precision_bit_for_bit() {
    watchdog(300, || {
        let scaler = || LossScaler::new(256.0, ScaleMode::Static, 2.0, 1000).unwrap();
        let data = Data::new(8);
        let dir = work_dir("fp16");
        let mut run = runner(
            mlp(3),
            AdamConfig::new().init(),
            Fp16OptimizerHook::new(scaler()),
            data.clone(),
            RunLength::Iters(5),
            &dir,
        );
        run.set_lr(1e-2).unwrap();
        run.run().unwrap();
        let state = run.state();
        assert_eq!(
            state.model.fc1.weight.val().dtype(),
            DType::F32,
            "fp32 masters"
        );
        let half = state.forward_model.as_ref().expect("the half copy");
        assert_eq!(half.fc1.weight.val().dtype(), DType::F16);
        let trained = param_bits(&run.into_model());

        let mut masters = mlp(3);
        let mut optimizer = AdamConfig::new().init();
        let mut amp = MixedPrecision::new(Precision::F16, scaler());
        for iter in 0..5 {
            let half = amp.half_model(&masters);
            let (x, y) = data.at(iter, &device());
            let grads = amp.backward(half.loss(x, y));
            (masters, _) = amp.step(&mut optimizer, 1e-2, masters, &half, grads);
        }
        assert_eq!(trained, param_bits(&masters));
    });
}

#[test]
fn an_overflow_skips_the_step_and_the_scale_backs_off() {
    watchdog(300, || {
        // Window 2: two clean steps double the scale. Iteration 1's inputs overflow f16.
        let scaler = LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2).unwrap();
        let mut data = Data::new(8);
        data.loud = vec![1];
        let dir = work_dir("overflow");
        let mut run = runner(
            mlp(4),
            SgdConfig::new().init(),
            Fp16OptimizerHook::new(scaler),
            data,
            RunLength::Iters(4),
            &dir,
        );
        run.set_lr(0.1).unwrap();
        let probe = Probe::default();
        run.register_hook(Box::new(probe.clone()));
        run.run().unwrap();
        let seen: Vec<(bool, bool, Option<f64>)> = probe
            .seen()
            .into_iter()
            .map(|(_, log)| (log.stepped, log.overflow, log.loss_scale))
            .collect();
        assert_eq!(
            seen,
            [
                (true, false, Some(65536.0)),
                (false, true, Some(32768.0)),
                (true, false, Some(32768.0)),
                (true, false, Some(65536.0)),
            ]
        );
        let warnings = run.state().warnings().join("\n");
        assert!(
            warnings.contains("iteration 1: gradient overflow (inf or NaN) at loss scale 65536"),
            "{warnings}"
        );
    });
}

#[test]
fn sixteen_bit_weights_train_the_hand_written_steps_bits() {
    watchdog(300, || {
        let data = Data::new(8);
        let dir = work_dir("weights16");
        let optimizer = || {
            Weights16::new(AdamWConfig::new().build())
                .with_seed(5)
                .init()
        };
        let mut run = runner(
            mlp(5),
            optimizer(),
            OptimizerHook::new().with_weights16(Precision::Bf16),
            data.clone(),
            RunLength::Iters(4),
            &dir,
        );
        run.set_lr(1e-2).unwrap();
        let probe = Probe::default();
        run.register_hook(Box::new(probe.clone()));
        run.run().unwrap();
        assert!(
            run.state().forward_model.is_none(),
            "no copy: the forward runs on the weights"
        );
        // bf16 keeps fp32's range: no loss scale, none logged.
        assert!(probe.seen().iter().all(|(_, log)| log.loss_scale.is_none()));
        let trained = run.into_model();
        assert_eq!(trained.fc1.weight.val().dtype(), DType::BF16);

        let mut model = wrap_fp16_model(mlp(5), Precision::Bf16);
        let mut optimizer = optimizer();
        for iter in 0..4 {
            let (x, y) = data.at(iter, &device());
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            let mut sums = GradientsParams::new();
            grads::accumulate(&model, &mut sums, grads, Some(DType::F32));
            model = optimizer.step(1e-2, model, sums);
        }
        assert_eq!(param_bits(&trained), param_bits(&model));
    });
}

/// Fails the run when it reaches iteration `at`.
struct StopAt(usize);

impl Hook<Mlp> for StopAt {
    fn name(&self) -> &'static str {
        "stop"
    }

    fn before_iter(&mut self, state: &mut TrainState<Mlp>) -> memsave_next::Result<()> {
        if state.iter == self.0 {
            return Err(Error::invalid("stop", "the test stops here"));
        }
        Ok(())
    }
}

#[test]
fn a_run_resumed_from_its_snapshot_continues_bit_for_bit() {
    watchdog(300, || {
        let data = Data::new(8);
        // A dynamic scale that moves (window 2) and accumulation in pairs.
        let hook = || {
            GradientCumulativeFp16OptimizerHook::new(
                2,
                LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 2).unwrap(),
            )
            .unwrap()
        };
        let make = |seed: u64, dir: &std::path::Path| {
            let mut run = runner(
                mlp(seed),
                AdamConfig::new().init(),
                hook(),
                data.clone(),
                RunLength::Iters(8),
                dir,
            );
            run.set_lr(1e-2).unwrap();
            let mut snapshots = SnapshotHook::new(4, false);
            snapshots.max_keep = Some(1);
            run.register_hook(Box::new(snapshots));
            let probe = Probe::default();
            run.register_hook(Box::new(probe.clone()));
            (run, probe)
        };
        let scales = |probe: &Probe| -> Vec<Option<f64>> {
            probe
                .seen()
                .into_iter()
                .map(|(_, log)| log.loss_scale)
                .collect()
        };
        let whole_dir = work_dir("whole");
        let (mut whole, whole_probe) = make(6, &whole_dir);
        whole.run().unwrap();
        let whole_scales = scales(&whole_probe);
        // Two clean steps double the scale: it has moved by the snapshot at 4.
        assert_eq!(whole_scales[3], Some(2048.0), "{whole_scales:?}");
        assert_eq!(whole.state().iter, 8);
        assert!(whole_dir.join("iter_8.ckpt").exists() && whole_dir.join("latest.ckpt").exists());
        assert!(
            !whole_dir.join("iter_4.ckpt").exists(),
            "max_keep = 1 removed the older one"
        );
        let whole = param_bits(&whole.into_model());

        let dir = work_dir("stopped");
        let (mut stopped, _) = make(6, &dir);
        stopped.register_hook(Box::new(StopAt(5)));
        let error = stopped.run().unwrap_err().to_string();
        assert!(error.contains("the test stops here"), "{error}");
        let snapshot = dir.join("iter_4.ckpt");
        assert!(snapshot.exists());

        // Other weights, resumed: the snapshot's weights, optimizer, scaler and place.
        let (mut resumed, probe) = make(7, &dir);
        resumed.resume(&snapshot).unwrap();
        assert_eq!(resumed.state().iter, 4);
        resumed.run().unwrap();
        assert_eq!(param_bits(&resumed.into_model()), whole);
        assert_eq!(
            scales(&probe),
            whole_scales[4..],
            "the scaler resumed where it was"
        );

        // The snapshot holds the hook's scaler and group, under the hook's name.
        let saved = Snapshot::load(&snapshot).unwrap();
        let state = saved
            .hook("cumulative_fp16")
            .expect("the optimizer hook's state");
        assert!(
            state.get("loss_scaler").is_some() && state.get("groups").is_some(),
            "{state}"
        );
        assert_eq!(saved.meta.precision.as_deref(), Some("f16"));
    });
}

/// Records the hooks' order at `before_iter`.
struct Named(&'static str, Arc<Mutex<Vec<&'static str>>>);

impl Hook<Mlp> for Named {
    fn name(&self) -> &'static str {
        self.0
    }

    fn before_iter(&mut self, _state: &mut TrainState<Mlp>) -> memsave_next::Result<()> {
        self.1.lock().unwrap().push(self.0);
        Ok(())
    }
}

#[test]
fn hooks_run_by_priority_then_in_the_order_they_were_registered() {
    watchdog(300, || {
        let order = Arc::new(Mutex::new(Vec::new()));
        let dir = work_dir("order");
        let mut run = runner(
            mlp(8),
            SgdConfig::new().init(),
            OptimizerHook::new(),
            Data::new(4),
            RunLength::Iters(1),
            &dir,
        );
        run.set_lr(0.1).unwrap();
        for (name, priority) in [
            ("low", Priority::Low),
            ("normal 1", Priority::Normal),
            ("highest", Priority::Highest),
            ("normal 2", Priority::Normal),
            ("very high", Priority::VeryHigh),
        ] {
            run.register_hook_at(Box::new(Named(name, order.clone())), priority);
        }
        run.run().unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["highest", "very high", "normal 1", "normal 2", "low"]
        );
    });
}

#[test]
fn the_log_writes_mmcvs_lines_to_the_work_directory() {
    watchdog(300, || {
        let dir = work_dir("log");
        let mut run = runner(
            mlp(9),
            SgdConfig::new().init(),
            OptimizerHook::new(),
            Data::new(4),
            RunLength::Epochs(1),
            &dir,
        );
        run.set_lr(0.1).unwrap();
        run.register_hook(Box::new(LoggerHook::new(2)));
        run.run().unwrap();
        let log = std::fs::read_to_string(dir.join("train.log")).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 2, "{log}");
        assert!(
            lines[0].starts_with("Epoch [1][2/4]  lr: 1.000e-1  loss: "),
            "{log}"
        );
        assert!(
            lines[1].starts_with("Epoch [1][4/4]") && lines[1].contains("grad_norm: "),
            "{log}"
        );
    });
}

#[test]
fn a_users_mistakes_are_errors_that_name_what_to_change() {
    watchdog(300, || {
        let dir = work_dir("errors");
        // No learning rate.
        let mut run = runner(
            mlp(10),
            SgdConfig::new().init(),
            OptimizerHook::new(),
            Data::new(4),
            RunLength::Iters(2),
            &dir,
        );
        let error = run.run().unwrap_err().to_string();
        assert!(
            error.contains("`lr`") && error.contains("set_lr"),
            "{error}"
        );
        // A half model under mixed precision.
        let half = wrap_fp16_model(mlp(10), Precision::F16);
        let mut run = runner(
            half,
            SgdConfig::new().init(),
            Fp16OptimizerHook::default(),
            Data::new(4),
            RunLength::Iters(2),
            &dir,
        );
        run.set_lr(0.1).unwrap();
        let error = run.run().unwrap_err().to_string();
        assert!(
            error.contains("`fc1.weight` is half") && error.contains("fp32 model"),
            "{error}"
        );
        // No iteration.
        let error = Runner::new(
            mlp(10),
            SgdConfig::new().init(),
            Box::new(OptimizerHook::new()),
            Data::new(4),
            RunLength::Iters(0),
            &dir,
            device(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(error.contains("no iteration"), "{error}");
        // A snapshot written by memsave on Burn 0.21, and one of another model.
        let mut run = runner(
            mlp(10),
            SgdConfig::new().init(),
            OptimizerHook::new(),
            Data::new(4),
            RunLength::Iters(2),
            &dir,
        );
        let old = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/snapshots/written-on-burn-0.21.ckpt");
        let error = run.resume(&old).unwrap_err().to_string();
        assert!(
            error.contains("written-on-burn-0.21.ckpt") && error.contains("0.21"),
            "{error}"
        );
        let mut other = runner(
            Mlp::new(&device(), [6, 8, 3]),
            SgdConfig::new().init(),
            OptimizerHook::new(),
            Data::new(4),
            RunLength::Iters(2),
            &dir,
        );
        other.set_lr(0.1).unwrap();
        other.save_snapshot(&dir.join("other.ckpt")).unwrap();
        let error = run.resume(&dir.join("other.ckpt")).unwrap_err().to_string();
        assert!(error.contains("other.ckpt"), "{error}");
    });
}

/// An MLP with a layer the loss never reads.
#[memsave_macros::model]
#[derive(burn::module::Module, Debug)]
struct WithSpare {
    mlp: Mlp,
    spare: burn::nn::Linear,
}

impl TrainModel for WithSpare {
    type Batch = Batch;

    fn loss(&self, (x, y): Batch) -> Tensor<1> {
        self.mlp.loss(x, y)
    }
}

#[test]
fn detect_anomalous_params_names_the_parameters_without_a_gradient() {
    watchdog(300, || {
        let model = WithSpare {
            mlp: mlp(12),
            spare: burn::nn::LinearConfig::new(4, 4).init(&device()),
        };
        let runner = |detect: bool| {
            let mut run = Runner::new(
                model.clone(),
                SgdConfig::new().init(),
                Box::new(OptimizerHook::new().with_detect_anomalous_params(detect)),
                Data::new(4),
                RunLength::Iters(2),
                work_dir("anomalous"),
                device(),
            )
            .unwrap();
            run.set_lr(0.1).unwrap();
            run.run().unwrap();
            run.state().warnings().to_vec()
        };
        let warnings = runner(true);
        assert_eq!(warnings.len(), 2, "one a step: {warnings:?}");
        assert!(
            warnings[0].starts_with("iteration 0: these trainable parameters got no gradient")
                && warnings[0].ends_with("spare.weight, spare.bias"),
            "{warnings:?}"
        );
        assert!(runner(false).is_empty(), "off: nothing said");
    });
}
