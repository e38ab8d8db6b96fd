//! The models memsave's commands run (Burn 0.22), each registered once: its config section, how
//! it is built, its data, the config keys of its batch and its `with_cp`, and whether it is a
//! detector (`memsave test` evaluates it). The commands ask this module and never name a model
//! type.
//!
//! Adding a model: its config section (in [`crate::config`]), a `build_*` function below that
//! makes its model, data and hooks, and one line in [`ENTRIES`] and in [`build`]'s match.

use std::path::Path;

use burn::module::Module;
use burn::prelude::*;

use crate::classifier::ImageClassifier;
use crate::config::{
    AnyData, ClassifierSection, DataSection, DetectionDataSection, ModelKind, ModelType,
    RetinaNetSection,
};
use crate::data::synthetic::SyntheticClassification;
use crate::data::voc::loader::VocDetection;
use crate::data::voc::VOC_CLASSES;
use crate::eval::accuracy::AccuracyHook;
use crate::eval::hook::EvalHook;
use crate::eval::voc::ApMode;
use crate::memsave::checkpoint::CheckpointModule;
use crate::memsave::config::{Config, ModelKeys};
use crate::memsave::parallel::Shard;
use crate::memsave::planner::WithCp;
use crate::memsave::train::{DataSource, Hook, TrainModel};
use crate::memsave::{Error, Result};

/// One registered model.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// Its `model.type`.
    pub kind: ModelType,
    /// Its keys.
    pub keys: ModelKeys,
    /// Whether it is a VOC detector: `memsave test` evaluates it (VOC's mAP) and `memsave
    /// bench` measures it.
    pub detector: bool,
}

/// Every model, by `model.type`.
pub const ENTRIES: &[Entry] = &[
    Entry {
        kind: ModelType::ImageClassifier,
        keys: BACKBONE_KEYS,
        detector: false,
    },
    Entry {
        kind: ModelType::RetinaNet,
        keys: DETECTOR_KEYS,
        detector: true,
    },
];

/// The keys of a model whose checkpointed segments are its ResNet backbone's blocks.
pub const BACKBONE_KEYS: ModelKeys = ModelKeys {
    with_cp: "model.backbone.with_cp",
    batch: "data.samples_per_gpu",
    also_with_cp: &[],
};

/// A detector's: the backbone's switch, and the neck's and head's beside it.
pub const DETECTOR_KEYS: ModelKeys = ModelKeys {
    also_with_cp: &["model.neck.with_cp", "model.bbox_head.with_cp"],
    ..BACKBONE_KEYS
};

/// The entry of the model a config names (its data section is not read yet).
pub fn entry(config: &Path, sets: &[String]) -> Result<Entry> {
    let kind = Config::<ModelKind, AnyData>::load(config, sets)?.model.kind;
    Ok(*ENTRIES
        .iter()
        .find(|entry| entry.kind == kind)
        .expect("every ModelType has an entry"))
}

/// What a model is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A training run: with the evaluation the config asks for (on rank 0).
    Train,
    /// A few measured steps (`memsave plan`): no evaluation data is read.
    Measure,
}

/// What a command needs to build a config's model.
pub struct Setup<'a> {
    /// The config file.
    pub config: &'a Path,
    /// Its `--set` overrides.
    pub sets: &'a [String],
    /// What for.
    pub purpose: Purpose,
    /// The training device (with autodiff; the evaluation runs on it without).
    pub device: Device,
    /// The data this peer reads.
    pub shard: Shard,
}

/// A model built from its config, handed to a [`ModelJob`].
pub struct Built<M: TrainModel, D> {
    /// The model, every weight drawn.
    pub model: M,
    /// Its training data.
    pub data: D,
    /// Samples per micro-batch.
    pub batch: usize,
    /// The model's own hooks (a detector's evaluation).
    pub hooks: Vec<Box<dyn Hook<M>>>,
    /// Its checkpointing switch as the config sets it.
    pub with_cp: WithCp,
    /// Its keys.
    pub keys: ModelKeys,
}

/// What a command does with the model of a config, whatever its type.
pub trait ModelJob {
    /// What the job returns.
    type Output;

    /// Runs the job on `built`, built from `config` (whose `[model]` is the model's own section
    /// `S`).
    fn run<S, D, M, Data>(
        self,
        config: &Config<S, D>,
        built: Built<M, Data>,
    ) -> Result<Self::Output>
    where
        M: TrainModel + CheckpointModule,
        Data: DataSource<M::Batch> + 'static;
}

/// Held while a model is seeded and its weights drawn: the peers of a data-parallel run share
/// the backend's random stream, and drawing one model at a time keeps each draw the seed's (a
/// run's start is then the same on every run, and the same as alone).
static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `init` on a device seeded with `seed`, every (lazily initialised) weight drawn before the
/// next model is.
fn seeded<M: Module>(device: &Device, seed: u64, init: impl FnOnce() -> Result<M>) -> Result<M> {
    let _one_at_a_time = INIT.lock().unwrap_or_else(|e| e.into_inner());
    device.seed(seed);
    Ok(crate::resnet::initialized(init()?))
}

/// The evaluation a job runs: the config's, in a training run, on rank 0 (a measuring job trains
/// a few steps only and reads no evaluation data; rank 0 evaluates a data-parallel run).
fn evaluation(
    purpose: Purpose,
    shard: Shard,
    section: Option<&crate::memsave::config::EvaluationSection>,
) -> Option<&crate::memsave::config::EvaluationSection> {
    match purpose {
        Purpose::Train => section,
        Purpose::Measure => None,
    }
    .filter(|_| shard.rank == 0)
}

/// Builds the model, data and hooks of `setup.config` and runs `job` on them.
pub fn build<J: ModelJob>(setup: Setup<'_>, job: J) -> Result<J::Output> {
    let entry = entry(setup.config, setup.sets)?;
    match entry.kind {
        ModelType::ImageClassifier => build_classifier(setup, entry, job),
        ModelType::RetinaNet => build_retinanet(setup, entry, job),
    }
}

/// A detector's training pipeline where it draws several scales (multi-scale training);
/// `None` for a single scale or a model without a pipeline.
pub fn multiscale_training(
    config: &Path,
    sets: &[String],
) -> Result<Option<crate::data::voc::pipeline::MultiScaleTraining>> {
    use crate::data::voc::pipeline::{MultiScale, MultiScaleTraining, Pipeline};
    if entry(config, sets)?.kind != ModelType::RetinaNet {
        return Ok(None);
    }
    let config = Config::<RetinaNetSection, DetectionDataSection>::load(config, sets)?;
    let Some(steps) = config.data.train.pipeline else {
        return Ok(None);
    };
    let key = "data.train.pipeline".to_string();
    let pipeline = Pipeline::from_steps(&steps, &key)?;
    Ok(
        (pipeline.multiscale != MultiScale::Single).then_some(MultiScaleTraining {
            pipeline,
            steps,
            key,
        }),
    )
}

/// [`multiscale_training`] of a detector whose backbone has `with_cp = "dynamic"`.
pub fn dynamic_multiscale(
    config: &Path,
    sets: &[String],
) -> Result<Option<crate::data::voc::pipeline::MultiScaleTraining>> {
    let Some(multi) = multiscale_training(config, sets)? else {
        return Ok(None);
    };
    let detector = Config::<RetinaNetSection, DetectionDataSection>::load(config, sets)?;
    Ok((detector.model.backbone.with_cp == WithCp::Dynamic).then_some(multi))
}

/// Samples per micro-batch of a config's model.
pub fn batch_size(config: &Path, sets: &[String]) -> Result<usize> {
    Ok(match entry(config, sets)?.kind {
        ModelType::ImageClassifier => {
            match Config::<ClassifierSection, DataSection>::load(config, sets)?.data {
                DataSection::SyntheticClassification(data) => data.samples_per_gpu,
            }
        }
        ModelType::RetinaNet => {
            Config::<RetinaNetSection, DetectionDataSection>::load(config, sets)?
                .data
                .samples_per_gpu
        }
    })
}

fn build_classifier<J: ModelJob>(setup: Setup<'_>, entry: Entry, job: J) -> Result<J::Output> {
    let config = Config::<ClassifierSection, DataSection>::load(setup.config, setup.sets)?;
    let num_classes = config.model.classes()?;
    let DataSection::SyntheticClassification(data) = &config.data;
    let mut hooks: Vec<Box<dyn Hook<_>>> = Vec::new();
    if let Some(evaluation) = evaluation(setup.purpose, setup.shard, config.evaluation.as_ref()) {
        let metric = evaluation.metric.as_deref().unwrap_or("accuracy");
        if metric != "accuracy" {
            return Err(Error::invalid(
                "evaluation.metric",
                format!("`{metric}` is not known: a classifier is scored by \"accuracy\""),
            ));
        }
        let samples = evaluation.num_samples.unwrap_or(128);
        if samples == 0 {
            return Err(Error::invalid(
                "evaluation.num_samples",
                "must be at least 1",
            ));
        }
        // The training set's distribution with other noise: another seed, in order.
        let mut held_out = data.clone();
        held_out.seed = data.seed ^ 0x5EED_0F_7E57;
        held_out.num_samples = samples;
        held_out.samples_per_gpu = data.samples_per_gpu.min(samples);
        held_out.shuffle = false;
        let val = SyntheticClassification::new(held_out, num_classes, setup.device.clone())
            .map_err(|e| match e {
                Error::InvalidValue { field, message } => Error::invalid(
                    field.replace("data.num_samples", "evaluation.num_samples"),
                    message,
                ),
                other => other,
            })?;
        hooks.push(Box::new(AccuracyHook::new(
            val,
            evaluation.interval,
            config.runner.by_epoch(),
        )?));
    }
    let device = setup.device;
    let model = seeded(&device, config.seed, || {
        ImageClassifier::new(&config.model.backbone, num_classes, &device)
            .map_err(|e| e.within("model"))
    })?;
    let batch = data.samples_per_gpu;
    let data =
        SyntheticClassification::new(data.clone(), num_classes, device)?.with_shard(setup.shard);
    let built = Built {
        model,
        data,
        batch,
        hooks,
        with_cp: config.model.backbone.with_cp.clone(),
        keys: entry.keys,
    };
    job.run(&config, built)
}

fn build_retinanet<J: ModelJob>(setup: Setup<'_>, entry: Entry, job: J) -> Result<J::Output> {
    let config = Config::<RetinaNetSection, DetectionDataSection>::load(setup.config, setup.sets)?;
    let detector = config.model.retinanet()?;
    if detector.bbox_head.num_classes != VOC_CLASSES.len() {
        return Err(Error::invalid(
            "model.bbox_head.num_classes",
            format!(
                "a VOC detector tells the {} VOC classes apart, got {}",
                VOC_CLASSES.len(),
                detector.bbox_head.num_classes
            ),
        ));
    }
    let device = setup.device;
    let model = seeded(&device, config.seed, || {
        detector.init(&device).map_err(|e| e.within("model"))
    })?;
    let data_config = &config.data;
    let data = VocDetection::new_shard(
        &data_config.train,
        "data.train",
        true,
        data_config.samples_per_gpu,
        data_config.workers_per_gpu,
        config.seed,
        setup.shard,
        device.clone(),
    )?;
    let mut hooks: Vec<Box<dyn Hook<_>>> = Vec::new();
    if let Some(evaluation) = evaluation(setup.purpose, setup.shard, config.evaluation.as_ref()) {
        let metric = evaluation.metric.as_deref().unwrap_or("mAP");
        if metric != "mAP" {
            return Err(Error::invalid(
                "evaluation.metric",
                format!("`{metric}` is not known: a VOC detector is scored by \"mAP\""),
            ));
        }
        if evaluation.num_samples.is_some() {
            return Err(Error::invalid(
                "evaluation.num_samples",
                "a detector is scored on its `data.val` (or `data.test`) split: set the images \
                 there",
            ));
        }
        let (split, field) = match &data_config.val {
            Some(val) => (val, "data.val"),
            None => (&data_config.test, "data.test"),
        };
        let val = VocDetection::new(
            split,
            field,
            false,
            data_config.samples_per_gpu,
            data_config.workers_per_gpu,
            0,
            device.clone(),
        )?;
        let mode = if split.is_voc2007() {
            ApMode::ElevenPoints
        } else {
            ApMode::Area
        };
        hooks.push(Box::new(EvalHook::new(
            val,
            evaluation.interval,
            config.runner.by_epoch(),
            mode,
        )?));
    }
    let built = Built {
        model,
        data,
        batch: data_config.samples_per_gpu,
        hooks,
        with_cp: detector.with_cp(),
        keys: entry.keys,
    };
    job.run(&config, built)
}
