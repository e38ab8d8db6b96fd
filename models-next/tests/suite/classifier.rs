//! The main job on Burn 0.22: README's `configs/resnet18_synthetic.toml` (read by memsave-common's
//! `Config`, the file memsave on Burn 0.21 reads) builds the classifier, its synthetic data, the
//! optimizer and the runner's hooks on `memsave-next`, and the loss falls; with every block
//! checkpointed the run trains the same weights bit for bit; the data set is the same for the
//! same `(epoch, index)` and names a bad setting.

use crate::common;

use common::watchdog;
use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use memsave_models_next::classifier::{ClassificationBatch, ImageClassifier};
use memsave_models_next::data::synthetic::{
    SyntheticClassification, SyntheticClassificationConfig,
};
use memsave_models_next::resnet::ResNetConfig;
use memsave_next::config::{Config, ConfigHooks};
use memsave_next::train::{DataSource, Hook, Runner, TrainState};
use serde::Deserialize;

/// `[model]` of the main job's config.
#[derive(Deserialize)]
#[serde(tag = "type")]
enum Model {
    ImageClassifier {
        num_classes: usize,
        backbone: ResNetConfig,
    },
}

/// `[data]` of the main job's config.
#[derive(Deserialize)]
#[serde(tag = "type")]
enum Data {
    SyntheticClassification(SyntheticClassificationConfig),
}

/// Each iteration's loss, and its peak above the bytes live before it.
#[derive(Clone, Default)]
struct Losses(Arc<Mutex<Vec<f64>>>, Arc<Mutex<Vec<u64>>>, Arc<Mutex<u64>>);

impl Hook<ImageClassifier> for Losses {
    fn name(&self) -> &'static str {
        "losses"
    }

    fn before_iter(&mut self, state: &mut TrainState<ImageClassifier>) -> memsave_next::Result<()> {
        let meter = memsave_next::memory::meter_for(&state.device).unwrap();
        *self.2.lock().unwrap() = meter.reset_peak();
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<ImageClassifier>) -> memsave_next::Result<()> {
        self.0.lock().unwrap().extend(state.log.loss);
        let peak = memsave_next::memory::meter_for(&state.device)
            .unwrap()
            .peak();
        let rise = peak.saturating_sub(*self.2.lock().unwrap());
        self.1.lock().unwrap().push(rise);
        Ok(())
    }
}

/// The main job's config with `overrides` (`--set`), run on Burn 0.22 in `dir`: the trained
/// classifier, each iteration's loss, and each iteration's peak above the bytes live before it.
fn main_job(overrides: &[&str], dir: &str) -> (ImageClassifier, Vec<f64>, Vec<u64>) {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/resnet18_synthetic.toml");
    let config = Config::<Model, Data>::load(&path, &overrides).unwrap();
    let device = Device::flex().autodiff();
    device.seed(config.seed);
    let Model::ImageClassifier {
        num_classes,
        backbone,
    } = &config.model;
    let model = ImageClassifier::new(backbone, *num_classes, &device).unwrap();
    let Data::SyntheticClassification(data) = &config.data;
    let data = SyntheticClassification::new(data.clone(), *num_classes, device.clone()).unwrap();
    let dir =
        std::env::temp_dir().join(format!("memsave-models-next-{dir}-{}", std::process::id()));
    let mut runner = Runner::new(
        model,
        config.build_optimizer().unwrap(),
        config.optimizer_hook().unwrap(),
        data,
        config.run_length().unwrap(),
        dir,
        device,
    )
    .unwrap();
    for hook in config.hooks().unwrap() {
        runner.register_hook(hook);
    }
    let losses = Losses::default();
    runner.register_hook(Box::new(losses.clone()));
    runner.run().unwrap();
    let peaks = losses.1.lock().unwrap().clone();
    let losses = losses.0.lock().unwrap().clone();
    (runner.into_model(), losses, peaks)
}

fn param_bits<M: Module>(module: &M) -> Vec<Vec<u32>> {
    struct Values(Vec<Vec<u32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(
                param
                    .val()
                    .into_data()
                    .iter::<f32>()
                    .map(f32::to_bits)
                    .collect(),
            );
        }
    }
    let mut values = Values(Vec::new());
    module.valid().visit(&mut values);
    values.0
}

/// Narrow and short: 16 base channels, 96 images, 3 epochs.
const SMALL: [&str; 4] = [
    "model.backbone.base_channels=16",
    "data.num_samples=96",
    "runner.max_epochs=3",
    "log_config.interval=4",
];

#[test]
fn the_main_jobs_config_trains_the_classifier_and_the_loss_falls() {
    watchdog(300, || {
        let (_, losses, _) = main_job(&SMALL, "main");
        let mean = |part: &[f64]| part.iter().sum::<f64>() / part.len() as f64;
        let per_epoch = losses.len() / 3;
        let (first, last) = (
            mean(&losses[..per_epoch]),
            mean(&losses[losses.len() - per_epoch..]),
        );
        println!(
            "{} iterations: mean loss {first:.4} in the first epoch, {last:.4} in the last",
            losses.len()
        );
        assert_eq!(losses.len(), 36);
        assert!(last < first * 0.9, "{first} -> {last}: {losses:?}");
    });
}

#[test]
fn every_block_checkpointed_trains_the_same_classifier_bit_for_bit() {
    watchdog(300, || {
        let short = [
            "model.backbone.base_channels=8",
            "data.num_samples=24",
            "runner.max_epochs=1",
        ];
        let (plain, _, plain_peaks) = main_job(&short, "plain");
        let mut checkpointed = short.to_vec();
        checkpointed.push("model.backbone.with_cp=true");
        let (checkpointed, _, peaks) = main_job(&checkpointed, "checkpointed");
        assert!(param_bits(&plain) == param_bits(&checkpointed));
        // The key is read: every step peaks lower.
        let highest = |peaks: &[u64]| peaks.iter().copied().max().unwrap();
        println!(
            "step peak above the live bytes: plain {}, every block checkpointed {}",
            highest(&plain_peaks),
            highest(&peaks)
        );
        assert!(highest(&peaks) < highest(&plain_peaks));
    });
}

#[test]
fn the_synthetic_data_is_the_same_for_the_same_place_and_names_a_bad_setting() {
    let _turn = common::one_at_a_time();
    let device = Device::flex();
    let config = SyntheticClassificationConfig::new(4, 12, 16);
    let data = SyntheticClassification::new(config.clone(), 4, device.clone()).unwrap();
    assert_eq!(data.batches_per_epoch(), 3);
    let values = |batch: ClassificationBatch| -> (Vec<f32>, Vec<i64>) {
        (
            batch.images.into_data().iter::<f32>().collect(),
            batch.labels.into_data().iter::<i64>().collect(),
        )
    };
    let a = values(data.batch(1, 2, &device).unwrap());
    assert_eq!(a, values(data.batch(1, 2, &device).unwrap()));
    // Shuffled by the epoch.
    let epoch = |e| {
        (0..3)
            .flat_map(|i| values(data.batch(e, i, &device).unwrap()).1)
            .collect::<Vec<_>>()
    };
    assert_ne!(epoch(0), epoch(1));
    let mut zero = epoch(0);
    zero.sort();
    assert_eq!(zero, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
    let error = SyntheticClassification::new(
        SyntheticClassificationConfig::new(0, 12, 16),
        4,
        device.clone(),
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("data.samples_per_gpu"), "{error}");
    let error = data.batch(0, 3, &device).err().unwrap().to_string();
    assert!(error.contains("no batch 3"), "{error}");
}
