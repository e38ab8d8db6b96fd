//! One configuration of `memsave bench`, in a process of its own so that its peak is clean:
//! builds the detector and its data from the config, trains warm-up and measured steps on the
//! runner with the config's optimizer hook, and writes what it measured as JSON.
//!
//! How memory is measured and split (CPU, the counting allocator):
//! - the baseline of a step is the live bytes at its start (model, optimizer state, the
//!   preloaded batches; no gradients), and its peak the most live bytes until it ends;
//! - every block is charged to the phase that allocated it (`memsave::memory::phase`: the
//!   runner's `forward`, the optimizer hook's `backward` and `step`, the checkpointed segments'
//!   `recompute`), and the live bytes per phase are copied at each new peak;
//! - at the peak: `activations` = bytes of `forward` and `recompute` (what backward keeps, and
//!   recomputed activations), `gradients` = bytes of `backward` (the parameters' gradients so
//!   far, and under accumulation the group's sums, with the gradients in flight), `parameters`
//!   = the bytes the model took when it was built (and the half copy under mixed precision),
//!   `optimizer_state` = what the warm-up steps added to the live bytes (the momentum, Adam's
//!   moments, fp32 master weights' bookkeeping) less the half copy, `other` = the rest (the
//!   batches, the runtime).

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use memsave::config::{Config, ConfigHooks};
use memsave::hooks::LrUpdaterHook;
use memsave::memory::{self, phase};
use memsave::models::config::{DetectionDataSection, RetinaNetSection};
use memsave::models::data::voc::loader::{DatasetType, VocDatasetConfig, VocDetection};
use memsave::models::data::voc::pipeline::{ImgScale, Step};
use memsave::models::data::voc::OneOrMany;
use memsave::models::detection::retinanet::RetinaNet;
use memsave::models::detection::DetectionBatch;
use memsave::train::params::param_bytes;
use memsave::train::{DataSource, OptimizerKind, RunLength, Runner};
use memsave::{Error, Result};

use super::super::worker::Report;
use super::super::Device;
use super::measure::{Measure, Record};
use super::report::ConfigResult;

/// `memsave bench-worker`: one configuration (started by `memsave bench`).
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// The configuration's name (`base`, `amp`, ...).
    #[arg(long)]
    name: String,
    /// The RetinaNet config.
    #[arg(long)]
    config: PathBuf,
    /// The VOC2007 folder (its `ImageSets/Main/trainval.txt` is trained on).
    #[arg(long)]
    data: PathBuf,
    /// Image height.
    #[arg(long)]
    height: usize,
    /// Image width.
    #[arg(long)]
    width: usize,
    /// Measured optimizer steps.
    #[arg(long)]
    iters: usize,
    /// Steps before the measured ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// ResNet depth (the FPN's inputs follow).
    #[arg(long)]
    depth: Option<usize>,
    /// Adam instead of the config's optimizer.
    #[arg(long)]
    adam: bool,
    /// Random backbone weights, whatever the config's `init_cfg` says (the built-in config).
    #[arg(long)]
    random_init: bool,
    /// Where to run.
    #[arg(long, value_enum)]
    device: Device,
    /// Wait for a line on the standard input before each step (`memsave bench` paces its
    /// processes so that their steps take turns).
    #[arg(long)]
    paced: bool,
    /// Config overrides: the user's, the batch, the configuration's line.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

pub fn worker(args: WorkerArgs) -> Result<()> {
    super::super::worker::serve(|| {
        let result = crate::on_backend!(args.device, K => {
            let device: burn::tensor::Device<K> = Default::default();
            let meter: Rc<dyn memory::Meter> = match args.device {
                Device::Cpu => Rc::new(memory::AllocatorMeter),
                _ => Rc::from(memory::meter_for(&device).ok_or_else(|| {
                    Error::invalid("--device", "this device's memory cannot be read")
                })?),
            };
            run::<Autodiff<K>>(&args, device, meter)
        })?;
        super::super::worker::send(&Report::Done(result))
    })
}

/// MMDetection's training pipeline, the resize stretched to exactly `width` x `height`.
fn pipeline(width: usize, height: usize) -> Vec<Step> {
    vec![
        Step::LoadImageFromFile {},
        Step::LoadAnnotations { with_bbox: true },
        Step::Resize {
            img_scale: ImgScale::One([width, height]),
            keep_ratio: false,
            multiscale_mode: None,
        },
        Step::RandomFlip {
            flip_ratio: Some(0.5),
        },
        Step::Normalize {
            mean: [123.675, 116.28, 103.53],
            std: [58.395, 57.12, 57.375],
            to_rgb: true,
        },
        Step::Pad { size_divisor: 32 },
        Step::DefaultFormatBundle {},
    ]
}

/// The same images as `batch`, as `parts` batches of equal size, in order.
fn split<B: burn::prelude::Backend>(
    batch: DetectionBatch<B>,
    parts: usize,
) -> Vec<DetectionBatch<B>> {
    let n = batch.metas.len() / parts;
    (0..parts)
        .map(|p| DetectionBatch {
            images: batch.images.clone().narrow(0, p * n, n),
            metas: batch.metas[p * n..(p + 1) * n].to_vec(),
            gt_bboxes: batch.gt_bboxes[p * n..(p + 1) * n].to_vec(),
            gt_labels: batch.gt_labels[p * n..(p + 1) * n].to_vec(),
        })
        .collect()
}

/// Batches made before the run, served in turn: no decoding in the measured steps.
struct Preloaded<B: burn::prelude::Backend>(Vec<DetectionBatch<B>>);

impl<B: burn::prelude::Backend> DataSource<B, DetectionBatch<B>> for Preloaded<B> {
    fn batches_per_epoch(&self) -> usize {
        self.0.len()
    }
    fn batch(&self, _epoch: usize, index: usize, _device: &B::Device) -> Result<DetectionBatch<B>> {
        Ok(self.0[index % self.0.len()].clone())
    }
}

/// The config as a configuration runs it: `sets` applied, then the depth (with the FPN's
/// inputs), Adam, random weights; an error unless it is a RetinaNet.
pub fn load_config(
    path: &std::path::Path,
    sets: &[String],
    depth: Option<usize>,
    adam: bool,
    random_init: bool,
) -> Result<Config<RetinaNetSection, DetectionDataSection>> {
    if !memsave::models::registry::entry(path, sets)?.detector {
        return Err(Error::invalid(
            "model.type",
            format!(
                "{}: memsave bench runs a RetinaNet config (`type = \"RetinaNet\"`)",
                path.display()
            ),
        ));
    }
    let mut config = Config::<RetinaNetSection, DetectionDataSection>::load(path, sets)?;
    if let Some(depth) = depth {
        config.model.backbone.depth = depth;
        let expansion = if depth >= 50 { 4 } else { 1 };
        let base = config.model.backbone.base_channels;
        let neck = &mut config.model.neck;
        neck.in_channels = (0..neck.in_channels.len())
            .map(|i| (base << i) * expansion)
            .collect();
    }
    if random_init {
        config.model.backbone.init_cfg = None;
    }
    if adam {
        config.optimizer.lr = 1e-4;
        config.optimizer.kind = OptimizerKind::Adam {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-4,
        };
    }
    config.model.retinanet()?;
    Ok(config)
}

fn run<B>(
    args: &WorkerArgs,
    device: B::Device,
    meter: Rc<dyn memory::Meter>,
) -> Result<ConfigResult>
where
    B: AutodiffBackend + memsave::Backend,
{
    let config = load_config(
        &args.config,
        &args.set,
        args.depth,
        args.adam,
        args.random_init,
    )?;
    let detector = config.model.retinanet()?;
    let micro = config
        .optimizer_config
        .groups()
        .map_or(1, |groups| groups.cumulative_iters());

    // Two steps' worth of batches, each step's images split into its micro-batches.
    let train = VocDatasetConfig {
        kind: DatasetType::VOCDataset,
        ann_file: OneOrMany::One(args.data.join("ImageSets/Main/trainval.txt")),
        img_prefix: OneOrMany::One(args.data.clone()),
        pipeline: Some(pipeline(args.width, args.height)),
        skip_bad_images: false,
    };
    let per_step = config.data.samples_per_gpu * micro;
    let loader = VocDetection::<B>::new(
        &train,
        "--data",
        true,
        per_step,
        0,
        config.seed,
        device.clone(),
    )?;
    let steps = loader.batches_per_epoch().min(2);
    if steps == 0 {
        return Err(Error::Data(format!(
            "{}: fewer than {per_step} training images",
            args.data.display()
        )));
    }
    let mut batches = Vec::new();
    for index in 0..steps {
        batches.extend(split(loader.batch(0, index, &device)?, micro));
    }
    drop(loader);

    B::seed(&device, config.seed);
    memory::snapshot_peaks(meter.tags());
    let before_model = meter.live();
    let model: RetinaNet<B> = memory::scope("model", || {
        let model = detector.init::<B>(&device).map_err(|e| e.within("model"))?;
        let model = match &detector.with_cp() {
            memsave::planner::WithCp::Paths(paths) => {
                memsave::checkpoint::set_with_cp_paths(model, paths)?
            }
            _ => model,
        };
        // Materialise every (lazily initialised) parameter while the tag is open.
        param_bytes::<B, _>(&model);
        Ok::<_, Error>(model)
    })?;
    // The bytes the model keeps (weights, BatchNorm statistics): on the CPU, those live under
    // the tag its construction ran in; elsewhere, the growth of the live bytes.
    let parameters = if meter.tags() {
        memory::live_by_tag()
            .iter()
            .filter(|t| t.tag == "model" || t.tag.starts_with("model."))
            .map(|t| t.live.max(0) as u64)
            .sum()
    } else {
        meter.live().saturating_sub(before_model)
    };

    let work_dir = std::env::temp_dir().join(format!("memsave-bench-{}", std::process::id()));
    // On a device, the host's own bytes are measured too (the counting allocator), from here.
    let host_start = (!meter.tags() && memory::is_counting()).then(memory::current_bytes);
    let mut runner = Runner::new(
        model,
        config.optimizer(),
        config.optimizer_hook()?,
        Preloaded(batches),
        RunLength::Iters((args.warmup + args.iters) * micro),
        &work_dir,
        device,
    )?;
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: config.lr_schedule(),
    }));
    // `[offload] activations` (the optimizer's offload is the optimizer hook's).
    if let Some(setting) = config.offload.activations() {
        runner.register_hook(Box::new(memsave::hooks::OffloadHook::new(setting)));
    }
    let record = Rc::new(RefCell::new(Record::default()));
    runner.register_hook(Box::new(Measure {
        micro,
        paced: args.paced,
        warmup: args.warmup,
        last: args.warmup + args.iters - 1,
        meter: meter.clone(),
        record: record.clone(),
        started: None,
        timeline: None,
        losses: Vec::new(),
        host: host_start.is_some(),
    }));
    let keys = memsave::models::registry::entry(&args.config, &args.set)?.keys;
    let with_cp = &config.model.backbone.with_cp;
    if let Some(budget) = config.memory_budget(with_cp, &keys)? {
        let device = runner.state().device.clone();
        if *with_cp == memsave::planner::WithCp::Dynamic {
            // `dynamic`: the warm-up step is the profile, each later step chooses its own set.
            runner.register_hook(Box::new(memsave::planner::DynamicHook::new(
                budget, keys, &device,
            )?));
        } else {
            // `planned`: the planner profiles the warm-up step and checkpoints for the budget.
            runner.register_hook(Box::new(memsave::planner::AutoPlanHook::new(
                budget,
                config.planner_setting(config.data.samples_per_gpu),
                keys,
                &device,
            )?));
        }
    }
    let built = meter.live();
    runner.run()?;
    // Compressed weights (16-bit trainable ones, frozen ones held in the run's table): the
    // bytes the model no longer takes, which the warm-up's growth counted against the state.
    let shrunk = {
        let (now, _) = param_bytes::<B, _>(&runner.state().model);
        let frozen = runner.context().part::<memsave::nn::FrozenWeights>();
        let (_, held, placeholders) = frozen.held();
        parameters.saturating_sub(now.saturating_sub(placeholders) + held)
    };
    // The half copy of the weights the forward ran on (mixed precision), resident.
    let half_weights: u64 = memory::live_by_tag()
        .iter()
        .filter(|t| t.tag.split('.').any(|part| part == phase::HALF_WEIGHTS))
        .map(|t| t.live.max(0) as u64)
        .sum();
    drop(runner);
    let record = record.take();
    let mut result = summarise(
        args,
        &record,
        parameters.saturating_sub(shrunk),
        half_weights,
        built.saturating_sub(shrunk),
        meter.tags(),
    )?;
    result.host_peak_bytes = host_start
        .zip(record.host_peak)
        .map(|(start, peak)| peak.saturating_sub(start) as u64);
    Ok(result)
}

/// Samples kept of a timeline.
const TIMELINE_POINTS: usize = 1500;

/// The step with the highest peak, its breakdown, the median time, the timeline.
fn summarise(
    args: &WorkerArgs,
    record: &Record,
    parameters: u64,
    half_weights: u64,
    built: u64,
    phases: bool,
) -> Result<ConfigResult> {
    let (_, peak, at_peak, baseline) = record
        .steps
        .iter()
        .max_by_key(|step| step.1)
        .cloned()
        .ok_or_else(|| Error::Data("no step was measured".into()))?;
    let mut times: Vec<f64> = record.steps.iter().map(|step| step.0).collect();
    times.sort_by(f64::total_cmp);
    let median = if times.len() % 2 == 1 {
        times[times.len() / 2]
    } else {
        (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
    };
    let mut breakdown = std::collections::BTreeMap::new();
    breakdown.insert("baseline".to_string(), baseline);
    let added = record.resident.unwrap_or(built).saturating_sub(built);
    if phases {
        // Bytes each kind of tag added between the step's start and its peak.
        let sum = |keep: &dyn Fn(&str) -> bool| -> u64 {
            at_peak
                .iter()
                .filter(|t| keep(&t.tag))
                .map(|t| t.live.max(0) as u64)
                .sum()
        };
        let has = |tag: &str, name: &str| tag.split('.').any(|part| part == name);
        let half = half_weights;
        let activations = sum(&|t| {
            !has(t, phase::HALF_WEIGHTS)
                && (has(t, phase::RECOMPUTE) || t.starts_with(phase::FORWARD))
        });
        // A step in backward makes its new weights under `backward.step`: no gradients.
        let stepping = |t: &str| has(t, phase::STEP) || has(t, phase::HALF_WEIGHTS);
        let gradients =
            sum(&|t| t.starts_with(phase::BACKWARD) && !has(t, phase::RECOMPUTE) && !stepping(t));
        let update = sum(&|t| stepping(t));
        let total = baseline + peak;
        let parameters = parameters + half;
        let optimizer_state = added.saturating_sub(half);
        let known = parameters + optimizer_state + activations + gradients + update;
        breakdown.insert("parameters".to_string(), parameters);
        breakdown.insert("optimizer_state".to_string(), optimizer_state);
        breakdown.insert("activations".to_string(), activations);
        breakdown.insert("gradients".to_string(), gradients);
        breakdown.insert("optimizer_step".to_string(), update);
        breakdown.insert("other".to_string(), total.saturating_sub(known));
        breakdown.insert("total".to_string(), total);
    } else {
        // Bytes that left the device before the measured steps (the fp32 weights, under mixed
        // precision with optimizer offload: the half copy stays) are the model's.
        let left = built.saturating_sub(record.resident.unwrap_or(built));
        breakdown.insert("parameters".to_string(), parameters.saturating_sub(left));
        breakdown.insert("optimizer_state".to_string(), added);
    }
    // At most TIMELINE_POINTS samples, each the highest of its run of raw samples (a peak is
    // never smoothed away).
    let timeline: Vec<&memory::Sample> = record
        .timeline
        .chunks(record.timeline.len().div_ceil(TIMELINE_POINTS).max(1))
        .filter_map(|run| run.iter().max_by_key(|s| s.bytes))
        .collect();
    let start = record
        .timeline
        .first()
        .map_or(0, |s| s.bytes as u64)
        .min(baseline);
    Ok(ConfigResult {
        name: args.name.clone(),
        peak_bytes: peak,
        whole_step_peak_bytes: baseline + peak,
        median_iter_s: median,
        final_loss: record.losses.last().copied().unwrap_or(f64::NAN),
        breakdown,
        iter_s: record.steps.iter().map(|step| step.0).collect(),
        timeline: timeline
            .iter()
            .map(|s| (s.seconds, (s.bytes as u64).saturating_sub(start)))
            .collect(),
        timeline_phase: timeline
            .iter()
            .map(|s| s.tag.split('.').next().unwrap_or_default().to_string())
            .collect(),
        peak_tags: at_peak
            .iter()
            .filter(|t| t.live != 0)
            .map(|t| (t.tag.clone(), t.live))
            .collect(),
        recomputations: record.recomputations,
        host_peak_bytes: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tensor;

    #[test]
    fn split_keeps_images_in_order() {
        type B = burn::backend::Flex;
        let device = Default::default();
        let values: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let images = Tensor::<B, 1>::from_floats(values.as_slice(), &device).reshape([4, 3, 1, 1]);
        let meta = |i: usize| memsave::models::detection::ImageMeta {
            id: format!("{i:06}"),
            ori_shape: [1, 1],
            img_shape: [1, 1],
            pad_shape: [1, 1],
            scale_factor: [1.0; 2],
            flip: false,
        };
        let batch = DetectionBatch::<B> {
            images,
            metas: (0..4).map(meta).collect(),
            gt_bboxes: vec![Vec::new(); 4],
            gt_labels: (0..4).map(|i| vec![i]).collect(),
        };
        let parts = split(batch, 2);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1].gt_labels, vec![vec![2], vec![3]]);
        let values: Vec<f32> = parts[1].images.clone().into_data().to_vec().unwrap();
        assert_eq!(values, (6..12).map(|v| v as f32).collect::<Vec<_>>());
    }
}
