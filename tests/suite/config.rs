//! The TOML config: MMCV's switch names, one line per strategy, `--set`, `_base_`, and errors
//! that name the key and what to write instead.

use crate::common;

use std::path::{Path, PathBuf};

use common::tiny::TinyNet;
use common::AB;
use memsave::config::{Config, ConfigHooks, LossScaleSpec};
use memsave::models::config::{ClassifierSection, DataSection};
use memsave::scaler::ScaleMode;
use memsave::train::RunLength;

type Cfg = Config<ClassifierSection, DataSection>;

const BASE: &str = r#"
[model]
type = "ImageClassifier"
num_classes = 4
[model.backbone]
depth = 18

[data]
type = "SyntheticClassification"
samples_per_gpu = 2
num_samples = 8
image_size = 16

[optimizer]
type = "SGD"
lr = 0.01
momentum = 0.9
weight_decay = 1e-4

[runner]
type = "EpochBasedRunner"
max_epochs = 2
"#;

fn parse(extra: &str) -> memsave::Result<Cfg> {
    Cfg::parse(&format!("{BASE}\n{extra}"), Path::new("test.toml"), &[])
}

fn error(extra: &str) -> String {
    parse(extra).unwrap_err().to_string()
}

fn hook_name(config: &Cfg) -> &'static str {
    config.optimizer_hook::<AB, TinyNet<AB>>().unwrap().name()
}

#[test]
fn the_base_config_is_plain_training() {
    let config = parse("").unwrap();
    assert_eq!(hook_name(&config), "optimizer");
    assert_eq!(config.run_length().unwrap(), RunLength::Epochs(2));
    assert!(!config.model.backbone.with_cp.starts_on());
}

#[test]
fn each_strategy_is_one_line() {
    let fp16 = parse("[fp16]\nloss_scale = 512.0").unwrap();
    assert_eq!(hook_name(&fp16), "fp16");
    let accumulation = parse(
        "[optimizer_config]\ntype = \"GradientCumulativeOptimizerHook\"\ncumulative_iters = 2",
    )
    .unwrap();
    assert_eq!(hook_name(&accumulation), "cumulative");
    let checkpointing = Cfg::parse(
        BASE,
        Path::new("test.toml"),
        &["model.backbone.with_cp=true".to_string()],
    )
    .unwrap();
    assert!(checkpointing.model.backbone.with_cp.starts_on());
    assert_eq!(hook_name(&checkpointing), "optimizer");
    let both = parse(
        "[fp16]\nloss_scale = \"dynamic\"\n[optimizer_config]\ntype = \"GradientCumulativeOptimizerHook\"\ncumulative_iters = 2",
    )
    .unwrap();
    assert_eq!(hook_name(&both), "cumulative_fp16");
}

#[test]
fn loss_scale_takes_a_number_an_integer_dynamic_or_a_table() {
    let scale = |text: &str| {
        parse(&format!("[fp16]\n{text}"))
            .unwrap()
            .fp16
            .unwrap()
            .loss_scale
    };
    assert_eq!(scale("loss_scale = 512.0"), LossScaleSpec::Static(512.0));
    assert_eq!(scale("loss_scale = 512"), LossScaleSpec::Static(512.0));
    assert_eq!(scale("loss_scale = \"dynamic\""), LossScaleSpec::Dynamic);
    let table = scale("loss_scale = { init_scale = 1024.0, growth_interval = 50 }");
    let scaler = table.scaler().unwrap();
    assert_eq!(scaler.loss_scale(), 1024.0);
    assert_eq!(scaler.mode(), ScaleMode::Dynamic);
    let dynamic = LossScaleSpec::Dynamic.scaler().unwrap();
    assert_eq!(dynamic.loss_scale(), 65536.0, "GradScaler's default");
    // MMCV's LossScaler names are accepted as aliases.
    let mmcv = scale("loss_scale = { init_scale = 8.0, scale_factor = 4.0, scale_window = 3, mode = \"dynamic\" }");
    let mut scaler = mmcv.scaler().unwrap();
    for _ in 0..3 {
        scaler.update_scale(false);
    }
    assert_eq!(scaler.loss_scale(), 32.0);
}

#[test]
fn wrong_loss_scales_name_the_key() {
    let message = error("[fp16]\nloss_scale = \"dynamc\"");
    assert!(
        message.contains("fp16.loss_scale") && message.contains("\"dynamic\""),
        "{message}"
    );
    let message = error("[fp16]\nloss_scale = -4.0");
    assert!(
        message.contains("fp16.loss_scale") && message.contains("positive"),
        "{message}"
    );
    let message = error("[fp16]\nloss_scale = { init_scal = 2.0 }");
    assert!(
        message.contains("init_scal") && message.contains("init_scale"),
        "{message}"
    );
}

#[test]
fn unknown_keys_suggest_the_closest_one() {
    let message = error(
        "[optimizer_config]\ntype = \"GradientCumulativeOptimizerHook\"\ncumulative_iter = 2",
    );
    assert!(
        message.contains("optimizer_config.cumulative_iter")
            && message.contains("did you mean `cumulative_iters`"),
        "{message}"
    );
    let message = error("[optimiser_config]\ntype = \"OptimizerHook\"");
    assert!(
        message.contains("did you mean `optimizer_config`"),
        "{message}"
    );
    let message = error("[log_config]\nintervall = 5");
    assert!(
        message.contains("log_config.intervall") && message.contains("`interval`"),
        "{message}"
    );
    assert!(
        message.contains("test.toml"),
        "the file is named: {message}"
    );
}

#[test]
fn unknown_types_suggest_the_closest_one() {
    let message = error("[optimizer_config]\ntype = \"GradientCumulativeOptimizerHok\"");
    assert!(
        message.contains("GradientCumulativeOptimizerHok")
            && message.contains("did you mean `GradientCumulativeOptimizerHook`"),
        "{message}"
    );
    let message = Cfg::parse(
        BASE,
        Path::new("test.toml"),
        &["runner.type=\"IterBasedRuner\"".to_string()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.contains("runner.type") && message.contains("did you mean `IterBasedRunner`"),
        "{message}"
    );
}

#[test]
fn wrong_types_name_the_key_and_the_expected_type() {
    let accumulate = |value: &str| {
        error(&format!(
            "[optimizer_config]\ntype = \"GradientCumulativeOptimizerHook\"\ncumulative_iters = {value}"
        ))
    };
    let message = accumulate("\"2\"");
    assert!(
        message.contains("optimizer_config.cumulative_iters")
            && message.contains("string")
            && message.contains("non-negative integer"),
        "{message}"
    );
    let message = accumulate("0");
    assert!(
        message.contains("optimizer_config.cumulative_iters")
            && message.contains("positive integer"),
        "{message}"
    );
    let message = accumulate("-1");
    assert!(
        message.contains("optimizer_config.cumulative_iters") && message.contains("-1"),
        "{message}"
    );
    let message = error("[checkpoint_config]\ninterval = 1.5");
    assert!(message.contains("checkpoint_config.interval"), "{message}");
}

#[test]
fn cumulative_iters_belongs_to_the_accumulation_hook() {
    let message = error("[optimizer_config]\ncumulative_iters = 2");
    assert!(
        message.contains("GradientCumulativeOptimizerHook"),
        "{message}"
    );
}

#[test]
fn set_overrides_any_key() {
    let overrides = [
        "optimizer_config.type=\"GradientCumulativeOptimizerHook\"".to_string(),
        "optimizer_config.cumulative_iters=4".to_string(),
        "model.backbone.with_cp=true".to_string(),
        "fp16.loss_scale=256".to_string(),
        "runner.max_epochs=3".to_string(),
    ];
    let config = Cfg::parse(BASE, Path::new("test.toml"), &overrides).unwrap();
    assert_eq!(config.optimizer_config.cumulative_iters, Some(4));
    assert!(config.model.backbone.with_cp.starts_on());
    assert_eq!(config.run_length().unwrap(), RunLength::Epochs(3));
    assert_eq!(
        config.fp16.unwrap().loss_scale,
        LossScaleSpec::Static(256.0)
    );

    let bad = Cfg::parse(BASE, Path::new("test.toml"), &["runner".to_string()]).unwrap_err();
    assert!(bad.to_string().contains("key=value"), "{bad}");
    let bad = Cfg::parse(
        BASE,
        Path::new("test.toml"),
        &["optimizer.lr.x=1".to_string()],
    )
    .unwrap_err();
    assert!(
        bad.to_string().contains("`optimizer.lr` is not a table"),
        "{bad}"
    );
}

fn temp_configs() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-configs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn base_files_are_inherited_and_overridden() {
    let dir = temp_configs();
    std::fs::write(dir.join("base.toml"), BASE).unwrap();
    std::fs::write(
        dir.join("cp.toml"),
        "_base_ = \"base.toml\"\n[model.backbone]\nwith_cp = true\n",
    )
    .unwrap();
    let config = Cfg::load(&dir.join("cp.toml"), &[]).unwrap();
    assert!(config.model.backbone.with_cp.starts_on());
    assert_eq!(
        config.model.backbone.depth, 18,
        "the rest of the table is inherited"
    );

    std::fs::write(dir.join("a.toml"), "_base_ = \"b.toml\"\n").unwrap();
    std::fs::write(dir.join("b.toml"), "_base_ = \"a.toml\"\n").unwrap();
    let message = Cfg::load(&dir.join("a.toml"), &[]).unwrap_err().to_string();
    assert!(message.contains("cycle"), "{message}");
    let message = Cfg::load(&dir.join("nowhere.toml"), &[])
        .unwrap_err()
        .to_string();
    assert!(message.contains("nowhere.toml"), "{message}");
}

#[test]
fn the_shipped_configs_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let expected = [
        ("resnet18_synthetic.toml", "optimizer", false),
        ("resnet18_synthetic_fp16.toml", "fp16", false),
        ("resnet18_synthetic_accumulation.toml", "cumulative", false),
        ("resnet18_synthetic_checkpointing.toml", "optimizer", true),
        (
            "resnet18_synthetic_step_in_backward.toml",
            "optimizer",
            false,
        ),
        ("resnet18_synthetic_int8_state.toml", "optimizer", false),
        ("resnet18_synthetic_offload.toml", "optimizer", true),
        ("resnet18_synthetic_bf16_weights.toml", "optimizer", false),
    ];
    for (file, hook, with_cp) in expected {
        let config = Cfg::load(&root.join(file), &[]).unwrap();
        assert_eq!(hook_name(&config), hook, "{file}");
        assert_eq!(config.model.backbone.with_cp.starts_on(), with_cp, "{file}");
        assert_eq!(
            config.optimizer_hook_of().unwrap().step_in_backward,
            file.contains("step_in_backward"),
            "{file}"
        );
        assert_eq!(
            config.optimizer().state_dtype == memsave::train::StateDtype::Int8,
            file.contains("int8"),
            "{file}"
        );
        assert_eq!(
            config.optimizer().weights.dtype,
            if file.contains("bf16_weights") {
                memsave::train::WeightDtype::Bf16
            } else {
                memsave::train::WeightDtype::F32
            },
            "{file}"
        );
        let offload = file.contains("offload");
        assert_eq!(config.offload.activations().is_some(), offload, "{file}");
        assert_eq!(
            config.optimizer_hook_of().unwrap().optimizer_offload,
            offload,
            "{file}"
        );
    }
}

/// One default per setting: an empty section is the runtime type's `Default`.
#[test]
fn the_defaults_of_an_empty_section_are_the_runtime_types_defaults() {
    use memsave::config::{Fp16Section, GradScalerParams, OptimizerHookSection};
    use memsave::hooks::{LogConfig, LrSchedule, SnapshotConfig};
    use memsave::models::resnet::ResNetConfig;
    let config =
        parse("[optimizer_config]\n[fp16]\n[lr_config]\n[checkpoint_config]\n[log_config]")
            .unwrap();
    assert_eq!(config.optimizer_config, OptimizerHookSection::default());
    assert_eq!(config.fp16.clone().unwrap(), Fp16Section::default());
    assert_eq!(
        config.lr_config,
        LrSchedule {
            base_lr: 0.01,
            ..LrSchedule::default()
        }
    );
    assert_eq!(config.checkpoint_config, SnapshotConfig::default());
    assert_eq!(config.log_config, LogConfig::default());
    // Absent sections too.
    let bare = parse("").unwrap();
    assert_eq!(bare.optimizer_config, OptimizerHookSection::default());
    assert_eq!(bare.checkpoint_config, SnapshotConfig::default());
    // The table form of the loss scale, empty, is GradScaler's defaults, as "dynamic" is.
    let table = parse("[fp16]\nloss_scale = {}").unwrap();
    assert_eq!(
        table.fp16.unwrap().loss_scale,
        LossScaleSpec::Table(GradScalerParams::default())
    );
    assert_eq!(
        LossScaleSpec::Table(GradScalerParams::default())
            .scaler()
            .unwrap(),
        LossScaleSpec::Dynamic.scaler().unwrap()
    );
    // The backbone section is the backbone's own configuration.
    let backbone: ResNetConfig = toml::from_str("").unwrap();
    assert_eq!(backbone, ResNetConfig::default());
}

#[test]
fn a_bad_set_value_is_blamed_on_the_set_argument() {
    let message = Cfg::parse(
        BASE,
        Path::new("test.toml"),
        &["optimizer.lr=\"abc\"".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.starts_with("`--set optimizer.lr=\"abc\"`") && message.contains("optimizer.lr"),
        "{message}"
    );
    assert!(!message.contains("test.toml"), "{message}");
    let message = Cfg::parse(
        BASE,
        Path::new("test.toml"),
        &["optimizer_config.grad_clip={ max_norm = -1 }".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.contains("--set optimizer_config.grad_clip")
            && message.contains("optimizer_config.grad_clip.max_norm"),
        "{message}"
    );
    // A mistake in the file itself is still the file's.
    let message = error("[optimizer_config]\ngrad_clip = { max_norm = 0 }");
    assert!(message.contains("test.toml"), "{message}");
}

#[test]
fn unknown_optimizer_parameters_suggest_the_closest_one() {
    let message = Cfg::parse(
        &BASE.replace("momentum = 0.9", "momentun = 0.9"),
        Path::new("test.toml"),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(message.contains("did you mean `momentum`"), "{message}");
}

/// `weight_dtype` and `weight_rounding`: read (the run's seed seeds the draws), and a value
/// that is not one of theirs names the key and the choices.
#[test]
fn weight_compression_keys_are_read_and_bad_values_name_the_choices() {
    use memsave::train::{WeightDtype, WeightRounding};
    let with = |values: &str| BASE.replace("momentum = 0.9", &format!("momentum = 0.9\n{values}"));
    let config = Cfg::parse(
        &with("weight_dtype = \"f16\"\nweight_rounding = \"kahan\""),
        Path::new("test.toml"),
        &[],
    )
    .unwrap();
    let weights = config.optimizer().weights;
    assert_eq!(
        (weights.dtype, weights.rounding, weights.seed),
        (WeightDtype::F16, WeightRounding::Kahan, config.seed)
    );
    let defaults = parse("").unwrap().optimizer().weights;
    assert_eq!(
        (defaults.dtype, defaults.rounding),
        (WeightDtype::F32, WeightRounding::Stochastic)
    );
    for (values, key, choices) in [
        (
            "weight_dtype = \"bf17\"",
            "weight_dtype",
            ["fp32", "bf16", "f16"],
        ),
        (
            "weight_rounding = \"up\"",
            "weight_rounding",
            ["stochastic", "nearest", "kahan"],
        ),
    ] {
        let message = Cfg::parse(&with(values), Path::new("test.toml"), &[])
            .unwrap_err()
            .to_string();
        assert!(message.contains(key), "{message}");
        for choice in choices {
            assert!(message.contains(choice), "{message}");
        }
    }
}

#[test]
fn a_missing_base_file_names_the_config_that_includes_it() {
    let dir = temp_configs();
    let including = dir.join("includes-missing.toml");
    std::fs::write(&including, "_base_ = \"no-such-base.toml\"\n").unwrap();
    let message = Cfg::load(&including, &[]).unwrap_err().to_string();
    assert!(
        message.contains("includes-missing.toml") && message.contains("no-such-base.toml"),
        "{message}"
    );
}

#[test]
fn activation_offload_is_one_line_and_its_sizes_take_units() {
    use memsave::checkpoint::offload::ActivationOffload;
    let hook_names = |config: &Cfg| -> Vec<&'static str> {
        config
            .hooks::<AB, TinyNet<AB>>()
            .iter()
            .map(|hook| hook.name())
            .collect()
    };
    let off = parse("").unwrap();
    assert_eq!(off.offload.activations(), None);
    assert!(!hook_names(&off).contains(&"offload"));
    let on = parse("[offload]\nactivations = true").unwrap();
    assert_eq!(on.offload.activations(), Some(ActivationOffload::default()));
    assert!(hook_names(&on).contains(&"offload"));
    let tuned = parse(
        "[offload]\nactivations = true\nmin_bytes = \"4KiB\"\nmax_in_flight = 1048576\nprefetch = 3",
    )
    .unwrap();
    assert_eq!(
        tuned.offload.activations(),
        Some(ActivationOffload {
            min_bytes: 4096,
            max_in_flight: 1 << 20,
            prefetch: 3,
        })
    );
    let message = error("[offload]\nactivations = true\nmin_bytes = \"4 parsecs\"");
    assert!(
        message.contains("offload.min_bytes") && message.contains("not a size"),
        "{message}"
    );
    let message = error("[offload]\nactivation = true");
    assert!(message.contains("did you mean `activations`"), "{message}");
}
