//! A TOML config (memsave-common's `Config`, the file memsave on Burn 0.21 reads) makes the
//! optimizer and hooks of the runner on Burn 0.22 (`memsave_next::config::ConfigHooks`): a run
//! built from it trains the bits of the same run built by hand, and the settings Burn 0.22 does
//! not have yet are errors naming their key.

use std::path::Path;

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::SgdConfig;
use burn::prelude::*;
use burn::tensor::DType;
use memsave_next::config::{Config, ConfigHooks};
use memsave_next::fp16::Precision;
use memsave_next::hooks::{
    GradClip, GradientCumulativeFp16OptimizerHook, LoggerHook, LrUpdaterHook, OptimizerHook,
    SnapshotHook,
};
use memsave_next::optim8::Adam8;
use memsave_next::scaler::{LossScaler, ScaleMode};
use memsave_next::train::{DataSource, RunLength, Runner};
use memsave_next::weights16::Weights16;
use serde::de::IgnoredAny;

use crate::common;
use common::mlp::{batch, Mlp};
use common::{device, initialized, param_bits, watchdog};

type Batch = (Tensor<2>, Tensor<2>);

struct Data;

impl DataSource<Batch> for Data {
    fn batches_per_epoch(&self) -> usize {
        3
    }

    fn batch(&self, epoch: usize, index: usize, device: &Device) -> memsave_next::Result<Batch> {
        let at = epoch * 3 + index;
        Ok(batch(device, 8, [6, 3], [at * 5, at + 2], 1.0))
    }
}

type AnyConfig = Config<IgnoredAny, IgnoredAny>;

fn parse(text: &str) -> memsave_next::Result<AnyConfig> {
    Config::parse(text, Path::new("test.toml"), &[])
}

fn mlp() -> Mlp {
    device().seed(11);
    initialized(Mlp::new(&device(), [6, 16, 3]))
}

fn work_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("memsave-next-config-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A hidden layer past 8-bit state's smallest tensor (4096 values).
fn wide() -> Mlp {
    device().seed(12);
    initialized(Mlp::new(&device(), [6, 1024, 3]))
}

/// A run of `config` on `model`, its optimizer and hooks all from the config.
fn from_config(config: &AnyConfig, model: Mlp, dir: &Path) -> Runner<Mlp, Data> {
    let mut runner = Runner::new(
        model,
        config.build_optimizer().unwrap(),
        config.optimizer_hook().unwrap(),
        Data,
        config.run_length().unwrap(),
        dir,
        device(),
    )
    .unwrap();
    for hook in config.hooks().unwrap() {
        runner.register_hook(hook);
    }
    runner
}

const SGD_FP16: &str = r#"
seed = 7
[model]
[data]

[optimizer]
type = "SGD"
lr = 0.05
momentum = 0.9
weight_decay = 0.0001

[optimizer_config]
type = "GradientCumulativeOptimizerHook"
cumulative_iters = 2
grad_clip = { max_norm = 0.01, norm_type = 2.0 }

[fp16]
loss_scale = { init_scale = 1024.0, growth_interval = 2 }

[lr_config]
policy = "step"
step = [4]
by_epoch = false
warmup = "linear"
warmup_iters = 2
warmup_ratio = 0.5

[runner]
type = "IterBasedRunner"
max_iters = 6

[checkpoint_config]
interval = 3
by_epoch = false

[log_config]
interval = 2
"#;

#[test]
fn a_run_from_a_config_is_the_run_built_by_hand_bit_for_bit() {
    watchdog(300, || {
        let config = parse(SGD_FP16).unwrap();
        let dir = work_dir("sgd");
        let mut run = from_config(&config, mlp(), &dir);
        run.run().unwrap();
        assert!(dir.join("iter_3.ckpt").exists() && dir.join("iter_6.ckpt").exists());
        let log = std::fs::read_to_string(dir.join("train.log")).unwrap();
        assert_eq!(log.lines().count(), 3, "{log}");
        assert!(
            log.contains("loss_scale: 2048"),
            "the scale grew every two steps: {log}"
        );
        let ours = param_bits(&run.into_model());

        let by_hand = |max_norm: f64| {
            let dir = work_dir("sgd-hand");
            let optimizer = SgdConfig::new()
                .with_momentum(Some(MomentumConfig {
                    momentum: 0.9,
                    dampening: 0.0,
                    nesterov: false,
                }))
                .with_weight_decay(Some(WeightDecayConfig::new(1e-4)))
                .init();
            let scaler = LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 2).unwrap();
            let hook = GradientCumulativeFp16OptimizerHook::new(2, scaler)
                .unwrap()
                .with_grad_clip(Some(GradClip::new(max_norm, 2.0).unwrap()));
            let mut run = Runner::new(
                mlp(),
                optimizer,
                Box::new(hook),
                Data,
                RunLength::Iters(6),
                &dir,
                device(),
            )
            .unwrap();
            let schedule = config.lr_schedule();
            assert_eq!(schedule.base_lr, 0.05);
            run.register_hook(Box::new(LrUpdaterHook::new(schedule).unwrap()));
            run.register_hook(Box::new(SnapshotHook::new(3, false)));
            run.register_hook(Box::new(LoggerHook::new(2)));
            run.run().unwrap();
            param_bits(&run.into_model())
        };
        assert_eq!(ours, by_hand(0.01));
        // The clipping is read: another max_norm trains other weights.
        assert_ne!(ours, by_hand(100.0));
    });
}

#[test]
fn eight_bit_adamw_with_bf16_weights_from_a_config_is_the_hand_built_optimizer() {
    watchdog(300, || {
        let text = r#"
            seed = 9
            [model]
            [data]
            [optimizer]
            type = "AdamW"
            lr = 0.001
            weight_decay = 0.01
            state_dtype = "int8"
            weight_dtype = "bf16"
            [runner]
            type = "EpochBasedRunner"
            max_epochs = 2
            [checkpoint_config]
            interval = 0
            save_last = false
        "#;
        let config = parse(text).unwrap();
        let dir = work_dir("adamw");
        let mut run = from_config(&config, wide(), &dir);
        run.run().unwrap();
        let trained = param_bits(&run.state().model);
        assert_eq!(run.state().model.fc1.weight.val().dtype(), DType::BF16);
        assert!(
            !dir.join("epoch_2.ckpt").exists(),
            "save_last = false is read"
        );

        let by_hand = |eight_bit: bool| {
            let optimizer = Weights16::new(
                Adam8::adamw()
                    .with_betas(0.9, 0.999)
                    .with_epsilon(1e-8)
                    .with_weight_decay(0.01)
                    .with_eight_bit(eight_bit),
            )
            .with_seed(9)
            .init();
            let mut run = Runner::new(
                wide(),
                optimizer,
                Box::new(OptimizerHook::new().with_weights16(Precision::Bf16)),
                Data,
                RunLength::Epochs(2),
                work_dir("adamw-hand"),
                device(),
            )
            .unwrap();
            run.set_lr(0.001).unwrap();
            run.run().unwrap();
            param_bits(&run.into_model())
        };
        assert_eq!(trained, by_hand(true));
        // The state's type is read: fp32 moments train other weights.
        assert_ne!(trained, by_hand(false));
    });
}

#[test]
fn settings_burn_0_22_does_not_have_yet_are_errors_naming_their_key() {
    let _turn = common::one_at_a_time();
    let base = "[model]\n[data]\n[runner]\ntype = \"IterBasedRunner\"\nmax_iters = 2\n";
    let sgd = "[optimizer]\ntype = \"SGD\"\nlr = 0.1\n";
    let cases = [(
        format!("{base}{sgd}[optimizer_config]\nzero_stage = 1\n"),
        "optimizer_config.zero_stage",
    )];
    for (text, key) in cases {
        let error = parse(&text)
            .unwrap()
            .optimizer_hook_of()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(key) && error.contains("Burn 0.22"),
            "{error}"
        );
    }
    // The step in backward is read (`next/tests/suite/in_backward.rs` trains with it).
    for on in [false, true] {
        let text = format!("{base}{sgd}[optimizer_config]\nstep_in_backward = {on}\n");
        let hook = parse(&text).unwrap().optimizer_hook_of().unwrap();
        assert_eq!(hook.step_in_backward(), on);
        // Optimizer offload is read (`next/tests/suite/offload.rs` trains with it), and steps in
        // backward.
        let text = format!("{base}{sgd}[offload]\noptimizer = {on}\n");
        let hook = parse(&text).unwrap().optimizer_hook_of().unwrap();
        assert_eq!(hook.optimizer_offload(), on);
        assert_eq!(hook.step_in_backward(), on);
    }
    let text = format!("{base}{sgd}[offload]\nactivations = true\n");
    let error = match parse(&text).unwrap().hooks::<Mlp>() {
        Err(error) => error.to_string(),
        Ok(_) => panic!("activation offload was accepted"),
    };
    assert!(error.contains("offload.activations"), "{error}");
    // Frozen weights held compressed are the optimizer hook's (`next/tests/suite/frozen.rs`).
    let text = format!("{base}[optimizer]\ntype = \"SGD\"\nlr = 0.1\nfrozen_dtype = \"int8\"\n");
    let config = parse(&text).unwrap();
    assert!(config.build_optimizer().is_ok());
    let hook = config.optimizer_hook_of().unwrap();
    assert_eq!(
        hook.frozen_dtype(),
        Some(memsave_next::frozen::FrozenDtype::Int8)
    );
    // A bad value is the config's error, naming the key, as on Burn 0.21.
    let text = format!("{base}[optimizer]\ntype = \"SGD\"\nlr = 0.1\nmomentum = 1.5\n");
    let error = parse(&text)
        .unwrap()
        .build_optimizer()
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("optimizer.momentum"), "{error}");
}
