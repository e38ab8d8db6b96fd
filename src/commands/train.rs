//! `memsave train CONFIG`: the classifier or the detector of the config, on the runner with
//! its hooks.

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use memsave::config::Config;
use memsave::models::classifier::ImageClassifier;
use memsave::models::config::{DataSection, DetectionDataSection, ModelSection, ModelType};
use memsave::models::data::voc::loader::VocDetection;
use memsave::models::data::voc::VOC_CLASSES;
use memsave::models::data::SyntheticClassification;
use memsave::models::eval::hook::EvalHook;
use memsave::models::eval::voc::ApMode;
use memsave::train::{DataSource, Hook, Runner, TrainModel};

use super::Device;

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// The config file.
    config: PathBuf,
    /// Where checkpoints and the log go (default: the config's `work_dir`, else
    /// `work_dirs/<config name>`).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Continue a run from this checkpoint (weights, optimizer, loss scale, position).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Override a config key, as TOML: `--set optimizer_config.cumulative_iters=4`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Where to train.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
}

/// Any `[data]` section (read per model, once the model is known).
type IgnoredData = memsave::models::config::AnyData;

/// The model type a config names (its data section is read per model).
pub fn model_type(config: &Path, set: &[String]) -> memsave::Result<ModelType> {
    Ok(Config::<ModelSection, IgnoredData>::load(config, set)?
        .model
        .kind)
}

pub fn train(args: TrainArgs) -> memsave::Result<()> {
    match args.device {
        Device::Cpu => train_on::<Autodiff<Flex>>(&args, Default::default(), Default::default()),
        #[cfg(feature = "cuda")]
        Device::Cuda => {
            train_on::<Autodiff<burn::backend::Cuda>>(&args, Default::default(), Default::default())
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(super::no_cuda()),
    }
}

fn work_dir<M, D>(args: &TrainArgs, config: &Config<M, D>) -> PathBuf {
    args.work_dir
        .clone()
        .or_else(|| config.work_dir.clone())
        .unwrap_or_else(|| {
            let name = args.config.file_stem().unwrap_or_default();
            PathBuf::from("work_dirs").join(name)
        })
}

/// Trains on `B` (on `device`); the evaluation runs on its inner backend (on `inner`, the same
/// device).
fn train_on<B>(
    args: &TrainArgs,
    device: B::Device,
    inner: <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    B::InnerBackend: memsave::Backend,
{
    match model_type(&args.config, &args.set)? {
        ModelType::ImageClassifier => {
            let config = Config::<ModelSection, DataSection>::load(&args.config, &args.set)?;
            let num_classes = config.model.classifier_classes()?;
            if config.evaluation.is_some() {
                return Err(memsave::Error::invalid(
                    "evaluation",
                    "only detectors are evaluated during training",
                ));
            }
            B::seed(&device, config.seed);
            let model = ImageClassifier::<B>::new(&config.model.backbone, num_classes, &device)?;
            let data = match &config.data {
                DataSection::SyntheticClassification(data) => {
                    SyntheticClassification::<B>::new(data.clone(), num_classes, device.clone())?
                }
            };
            run(args, &config, model, data, Vec::new(), device)
        }
        ModelType::RetinaNet => {
            let config =
                Config::<ModelSection, DetectionDataSection>::load(&args.config, &args.set)?;
            let detector = config.model.retinanet()?;
            if detector.bbox_head.num_classes != VOC_CLASSES.len() {
                return Err(memsave::Error::invalid(
                    "model.bbox_head.num_classes",
                    format!(
                        "a VOC detector tells the {} VOC classes apart, got {}",
                        VOC_CLASSES.len(),
                        detector.bbox_head.num_classes
                    ),
                ));
            }
            B::seed(&device, config.seed);
            let model = detector.init::<B>(&device)?;
            let data_config = &config.data;
            let data = VocDetection::<B>::new(
                &data_config.train,
                "data.train",
                true,
                data_config.samples_per_gpu,
                data_config.workers_per_gpu,
                config.seed,
                device.clone(),
            )?;
            let mut extra: Vec<Box<dyn Hook<B, _>>> = Vec::new();
            if let Some(evaluation) = &config.evaluation {
                if evaluation.metric != "mAP" {
                    return Err(memsave::Error::invalid(
                        "evaluation.metric",
                        format!(
                            "`{}` is not known: a VOC detector is scored by \"mAP\"",
                            evaluation.metric
                        ),
                    ));
                }
                let (split, field) = match &data_config.val {
                    Some(val) => (val, "data.val"),
                    None => (&data_config.test, "data.test"),
                };
                let val = VocDetection::<B::InnerBackend>::new(
                    split,
                    field,
                    false,
                    data_config.samples_per_gpu,
                    data_config.workers_per_gpu,
                    0,
                    inner,
                )?;
                let mode = if split.is_voc2007() {
                    ApMode::ElevenPoints
                } else {
                    ApMode::Area
                };
                extra.push(Box::new(EvalHook::<B>::new(
                    val,
                    evaluation.interval,
                    config.runner.by_epoch(),
                    mode,
                )?));
            }
            run(args, &config, model, data, extra, device)
        }
    }
}

fn run<B, M, D, Data>(
    args: &TrainArgs,
    config: &Config<ModelSection, D>,
    model: M,
    data: Data,
    extra: Vec<Box<dyn Hook<B, M>>>,
    device: B::Device,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    M: TrainModel<B>,
    Data: DataSource<M::Batch> + 'static,
{
    let work_dir = work_dir(args, config);
    let mut runner = Runner::new(
        model,
        &config.optimizer_kind(),
        config.optimizer_hook()?,
        data,
        config.run_length()?,
        &work_dir,
        device,
    )?;
    for hook in config.hooks() {
        runner.register_hook(hook);
    }
    for hook in extra {
        runner.register_hook(hook);
    }
    if let Some(checkpoint) = &args.resume {
        runner.resume(checkpoint)?;
        eprintln!(
            "memsave: resumed from {} at iteration {}",
            checkpoint.display(),
            runner.state().iter
        );
    }
    runner.run()?;
    eprintln!(
        "memsave: trained {} iterations; checkpoints and train.log in {}",
        runner.state().max_iters,
        work_dir.display()
    );
    Ok(())
}
