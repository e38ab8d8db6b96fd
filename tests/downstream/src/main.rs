//! A Burn user's own crate on memsave, as README's "Use memsave in your project" says to write
//! it: built by `scripts/downstream.sh` in a folder outside memsave's workspace, from README's
//! dependency lines, so that those lines stay true.
//!
//! A small regression model (a stem, three residual blocks, a head), checked first with
//! `memsave::check` (checkpointing changes no gradient and keeps less for backward), then trained
//! through burn-train's `SupervisedTraining` and `Learner` with mixed precision (f16, dynamic
//! loss scale), accumulation of 2 micro-batches and every block checkpointed, memsave's metrics
//! registered. Exits 1 with the reason if any of it is not so.

use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::Dataset;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{InferenceStep, RegressionOutput, SupervisedTraining};
use memsave::burn_train::{ForwardStep, Memsave};
use memsave::checkpoint::set_with_cp;
use memsave::fp16::{Fp16, Precision};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::{auto_fp16, force_fp32, with_cp};

type B = Autodiff<Flex>;

// The memory figures of `memsave::check` come from this allocator (on the CPU).
#[global_allocator]
static ALLOCATOR: memsave::memory::CountingAllocator = memsave::memory::CountingAllocator;

const WIDTH: usize = 256;
const FEATURES: usize = 8;
const SAMPLES: usize = 64;
const MICRO_BATCH: usize = 8;
const EPOCHS: usize = 2;

/// A residual block, recomputed in backward when `with_cp` is on.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    linear1: Linear<B>,
    linear2: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    /// `[batch, WIDTH]` -> `[batch, WIDTH]`.
    #[with_cp]
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = self.linear1.forward(x.clone()).tanh();
        self.linear2.forward(y) + x
    }
}

/// The model: half inside under mixed precision, its blocks checkpointable.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    stem: Linear<B>,
    #[with_cp]
    blocks: Vec<Block<B>>,
    head: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> Net<B> {
    pub fn new(device: &B::Device) -> Self {
        let block = || Block {
            linear1: LinearConfig::new(WIDTH, WIDTH).init(device),
            linear2: LinearConfig::new(WIDTH, WIDTH).init(device),
            with_cp: false,
        };
        Net {
            stem: LinearConfig::new(FEATURES, WIDTH).init(device),
            blocks: (0..3).map(|_| block()).collect(),
            head: LinearConfig::new(WIDTH, 1).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    /// `[batch, FEATURES]` -> `[batch, 1]`.
    #[auto_fp16(apply_to = (x))]
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut x = self.stem.forward(x);
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.head.forward(x)
    }

    /// Mean squared error, in fp32 whatever the forward ran in.
    #[force_fp32(args = (output))]
    fn loss(&self, output: Tensor<B, 2>, targets: Tensor<B, 2>) -> Tensor<B, 1> {
        MseLoss::new().forward(output, targets, Reduction::Mean)
    }

    pub fn regression(&self, batch: Points<B>) -> RegressionOutput<B> {
        let output = self.forward(batch.inputs);
        let loss = self.loss(output.clone(), batch.targets.clone());
        RegressionOutput::new(loss, output.cast(burn::tensor::DType::F32), batch.targets)
    }
}

impl<B: AutodiffBackend + memsave::Backend> ForwardStep for Net<B> {
    type Input = Points<B>;
    type Output = RegressionOutput<B>;

    fn forward_step(&self, batch: Points<B>) -> RegressionOutput<B> {
        self.regression(batch)
    }
}

impl<B: memsave::Backend> InferenceStep for Net<B> {
    type Input = Points<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Points<B>) -> RegressionOutput<B> {
        self.regression(batch)
    }
}

/// Point `i`: features from a fixed sequence, the target a smooth function of them.
#[derive(Clone, Debug)]
pub struct Point {
    features: [f32; FEATURES],
    target: f32,
}

struct PointSet;

impl Dataset<Point> for PointSet {
    fn get(&self, index: usize) -> Option<Point> {
        if index >= SAMPLES {
            return None;
        }
        let features: [f32; FEATURES] =
            std::array::from_fn(|j| ((index * 7 + j * 13) % 17) as f32 / 8.5 - 1.0);
        let target = features
            .iter()
            .enumerate()
            .map(|(j, f)| f * (j as f32 - 3.5) / 4.0)
            .sum();
        Some(Point { features, target })
    }

    fn len(&self) -> usize {
        SAMPLES
    }
}

#[derive(Clone, Debug)]
pub struct Points<B: Backend> {
    inputs: Tensor<B, 2>,
    targets: Tensor<B, 2>,
}

#[derive(Clone, Default)]
struct PointBatcher;

impl<B: Backend> Batcher<B, Point, Points<B>> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &B::Device) -> Points<B> {
        let n = items.len();
        let inputs: Vec<f32> = items.iter().flat_map(|p| p.features).collect();
        let targets: Vec<f32> = items.iter().map(|p| p.target).collect();
        Points {
            inputs: Tensor::from_data(TensorData::new(inputs, [n, FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n, 1]), device),
        }
    }
}

fn run() -> Result<(), String> {
    let device = Default::default();
    <B as Backend>::seed(&device, 7);
    let model = memsave::check::materialise(Net::<B>::new(&device));

    // 1. The check: gradients with and without checkpointing (and in f16), memory kept.
    let batch = PointBatcher.batch(
        (0..MICRO_BATCH).filter_map(|i| PointSet.get(i)).collect(),
        &device,
    );
    let report = memsave::check::ModelCheck::default()
        .with_precision(Precision::F16)
        .run_with_fp16(model.clone(), move |model: &Net<B>| {
            model.regression(batch.clone()).loss
        })
        .map_err(|error| format!("memsave::check: {error}"))?;
    println!("{report}");
    if report.worst_difference() != 0.0 {
        return Err(format!(
            "checkpointing changed the gradients by {}",
            report.worst_difference()
        ));
    }
    if report.segments.len() != 3 || report.segments.iter().any(|s| !s.checkpointed) {
        return Err(format!(
            "expected 3 checkpointed segments: {:?}",
            report.segments
        ));
    }
    let kept = |name: &str| report.pass(name).and_then(|pass| pass.kept_bytes);
    match (kept("fp32 plain"), kept("fp32 checkpointed")) {
        (Some(plain), Some(checkpointed)) if checkpointed < plain => {}
        other => {
            return Err(format!(
                "checkpointing kept no less (plain, checkpointed): {other:?}"
            ))
        }
    }

    // 2. Training in burn-train's Learner with memsave's strategies.
    let total_iters = EPOCHS * SAMPLES.div_ceil(MICRO_BATCH);
    let memsave = Memsave::new()
        .fp16(LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 1000).map_err(|e| e.to_string())?)
        .accumulate(2, total_iters)
        .map_err(|e| e.to_string())?;
    let learner = memsave
        .learner(set_with_cp(model, true), AdamConfig::new().init(), 1e-3)
        .map_err(|e| e.to_string())?;
    let train = DataLoaderBuilder::new(PointBatcher)
        .batch_size(MICRO_BATCH)
        .build(PointSet);
    let valid = DataLoaderBuilder::new(PointBatcher)
        .batch_size(MICRO_BATCH)
        .build(PointSet);
    let dir: PathBuf = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("memsave-downstream"));
    let training = SupervisedTraining::new(&dir, train, valid)
        .metrics(memsave.metrics())
        .num_epochs(EPOCHS);
    let _ = training.launch(learner);
    // What stopped the training, if anything (burn-train's loop has no error of its own).
    memsave.finish().map_err(|error| error.to_string())?;

    if memsave.iterations() != total_iters {
        return Err(format!(
            "{} micro-batches seen, not {total_iters}",
            memsave.iterations()
        ));
    }
    let last = memsave.last_step();
    if !last.stepped || last.group_size != 2 || last.micro_batch != 2 {
        return Err(format!(
            "the last micro-batch should end a group of 2 with a step: {last:?}"
        ));
    }
    // memsave's metrics reached burn-train's own logger (one line per micro-batch).
    let logged = find(&dir, "memsave_Loss_Scale.log")
        .ok_or_else(|| format!("no memsave_Loss_Scale.log under {}", dir.display()))?;
    let lines = std::fs::read_to_string(&logged).map_err(|e| e.to_string())?;
    if lines.lines().count() != SAMPLES.div_ceil(MICRO_BATCH) {
        return Err(format!(
            "{}: {} lines, not one per micro-batch",
            logged.display(),
            lines.lines().count()
        ));
    }
    println!(
        "memsave: {total_iters} micro-batches, last step {last:?}; {} logged",
        logged.display()
    );
    Ok(())
}

/// The first file named `name` under `dir`.
fn find(dir: &std::path::Path, name: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find(&path, name) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
    }
    None
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("downstream: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}
