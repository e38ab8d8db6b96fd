//! memsave in Burn's own training loop: the classifier of Burn's guide (its MNIST model, two
//! convolutions, adaptive pooling, dropout, two linear layers), trained with burn-train's
//! `SupervisedTraining` and `Learner` (its metrics, checkpoints and summary), on built-in
//! synthetic digits, with memsave's mixed precision, MMCV-exact accumulation, global-norm
//! clipping and checkpointing.
//!
//! ```text
//! cargo run --release --example burn_train                                 # fp32
//! cargo run --release --example burn_train -- --fp16 --accumulate 4 --with-cp
//! ```
//!
//! Switches: `--fp16` (f16 forward and backward on a half copy of the weights, a dynamic loss
//! scale from PyTorch's 65536, fp32 masters and Adam state), `--accumulate K` (K micro-batches
//! of 32 / K per step, each loss divided by K, the learning rate stepped per optimizer step),
//! `--with-cp` (the convolution block recomputed in backward), `--epochs N` (default 4).
//!
//! What changes from Burn's guide (`burn/examples/guide`): `#[memsave::model]` on the model;
//! `impl ForwardStep` (the body of `TrainStep::step` without `backward`) instead of
//! `impl TrainStep`; and `memsave.learner(..)` instead of `Learner::new(..)`.

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::Dataset;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{ClassificationOutput, InferenceStep, SupervisedTraining, TrainStep};
use memsave::burn_train::{ForwardStep, Memsave};
use memsave::checkpoint::set_with_cp;
use memsave::fp16::Fp16;
use memsave::memory::CountingAllocator;
use memsave::nn::{Dropout, DropoutConfig};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::{auto_fp16, force_fp32, with_cp};

type B = Autodiff<Flex>;

/// Counts the heap, for the step's peak the run reports.
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const CLASSES: usize = 10;
const SIZE: usize = 28;
const TRAIN_SAMPLES: usize = 2048;
const VALID_SAMPLES: usize = 512;
/// Samples per optimizer step (the micro-batch is this over `--accumulate`).
const BATCH: usize = 32;

/// Burn's guide model: conv, conv, pool, dropout, linear, linear. The convolutions are one
/// block, recomputed in backward under `--with-cp`.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Model<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    pool: AdaptiveAvgPool2d,
    dropout: Dropout,
    linear1: Linear<B>,
    linear2: Linear<B>,
    activation: Relu,
    fp16_enabled: Fp16,
    with_cp: bool,
}

impl<B: memsave::Backend> Model<B> {
    pub fn new(hidden: usize, dropout: f64, device: &B::Device) -> Self {
        Model {
            conv1: Conv2dConfig::new([1, 8], [3, 3]).init(device),
            conv2: Conv2dConfig::new([8, 16], [3, 3]).init(device),
            pool: AdaptiveAvgPool2dConfig::new([8, 8]).init(),
            dropout: DropoutConfig::new(dropout).init(),
            linear1: LinearConfig::new(16 * 8 * 8, hidden).init(device),
            linear2: LinearConfig::new(hidden, CLASSES).init(device),
            activation: Relu::new(),
            fp16_enabled: Fp16::Off,
            with_cp: false,
        }
    }

    /// The convolution block: only its input is kept when `with_cp` is on.
    #[with_cp]
    fn features(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = self
            .dropout
            .forward(self.activation.forward(self.conv1.forward(x)));
        let x = self
            .dropout
            .forward(self.activation.forward(self.conv2.forward(x)));
        self.pool.forward(x)
    }

    /// `[N, 28, 28]` images -> `[N, 10]` logits; half inside under `--fp16`.
    #[auto_fp16(apply_to = (images))]
    pub fn forward(&self, images: Tensor<B, 3>) -> Tensor<B, 2> {
        let [batch, height, width] = images.dims();
        let x = self.features(images.reshape([batch, 1, height, width]));
        let x = self.dropout.forward(
            self.activation
                .forward(self.linear1.forward(x.reshape([batch, 16 * 8 * 8]))),
        );
        self.linear2.forward(x)
    }

    /// Cross-entropy, in fp32 whatever the forward ran in.
    #[force_fp32(args = (logits))]
    fn loss(&self, logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets)
    }

    pub fn forward_classification(&self, batch: DigitBatch<B>) -> ClassificationOutput<B> {
        let logits = self.forward(batch.images);
        let loss = self.loss(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits.cast(DType::F32), batch.targets)
    }
}

/// Was `impl TrainStep`: the same body, without `loss.backward()` (memsave's wrapper does it,
/// scaled and divided).
impl<B: AutodiffBackend + memsave::Backend> ForwardStep for Model<B> {
    type Input = DigitBatch<B>;
    type Output = ClassificationOutput<B>;

    fn forward_step(&self, batch: DigitBatch<B>) -> ClassificationOutput<B> {
        self.forward_classification(batch)
    }
}

impl<B: memsave::Backend> InferenceStep for Model<B> {
    type Input = DigitBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: DigitBatch<B>) -> ClassificationOutput<B> {
        self.forward_classification(batch)
    }
}

/// A synthetic digit: class `c` is a bright bar whose row and slant depend on `c`, on noise.
#[derive(Clone, Debug)]
pub struct DigitItem {
    image: Vec<f32>,
    label: usize,
}

/// Deterministic synthetic digits (no download): item `i` of a split is the same every time.
struct Digits {
    len: usize,
    seed: u64,
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Dataset<DigitItem> for Digits {
    fn get(&self, index: usize) -> Option<DigitItem> {
        if index >= self.len {
            return None;
        }
        let mut state = self.seed ^ (index as u64).wrapping_mul(0x2545_F491_4F6C_DD1D);
        let label = (splitmix64(&mut state) % CLASSES as u64) as usize;
        let shift = (splitmix64(&mut state) % 3) as f32 - 1.0;
        let row = 4.0 + 5.0 * (label % 5) as f32 + shift;
        let slant = if label < 5 { 0.0 } else { 0.5 };
        let mut image = Vec::with_capacity(SIZE * SIZE);
        for y in 0..SIZE {
            for x in 0..SIZE {
                let centre = row + slant * (x as f32 - 14.0);
                let bar = (-((y as f32 - centre).powi(2)) / 2.0).exp();
                let noise = (splitmix64(&mut state) % 1000) as f32 / 1000.0;
                image.push(0.6 * bar + 1.5 * noise);
            }
        }
        Some(DigitItem { image, label })
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[derive(Clone, Debug)]
pub struct DigitBatch<B: Backend> {
    images: Tensor<B, 3>,
    targets: Tensor<B, 1, Int>,
}

#[derive(Clone, Default)]
struct DigitBatcher;

impl<B: Backend> Batcher<B, DigitItem, DigitBatch<B>> for DigitBatcher {
    fn batch(&self, items: Vec<DigitItem>, device: &B::Device) -> DigitBatch<B> {
        let n = items.len();
        let images: Vec<f32> = items.iter().flat_map(|item| item.image.clone()).collect();
        // Normalised as Burn's guide does MNIST's.
        let images = Tensor::<B, 3>::from_data(TensorData::new(images, [n, SIZE, SIZE]), device)
            .sub_scalar(0.3)
            .div_scalar(0.3);
        let labels: Vec<i64> = items.iter().map(|item| item.label as i64).collect();
        DigitBatch {
            images,
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// Prints nothing while training; burn-train's summary (every metric, every epoch) at the end.
struct Quiet;

impl MetricsRendererTraining for Quiet {
    fn update_train(&mut self, _: MetricState) {}
    fn update_valid(&mut self, _: MetricState) {}
    fn render_train(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}
    fn render_valid(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for Quiet {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
    fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for Quiet {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: burn::train::metric::MetricDefinition) {}
}

struct Args {
    fp16: bool,
    accumulate: usize,
    with_cp: bool,
    epochs: usize,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        fp16: false,
        accumulate: 1,
        with_cp: false,
        epochs: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut number = |name: &str| {
            it.next()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&v| v > 0)
                .ok_or(format!("{name} takes a whole number above 0"))
        };
        match arg.as_str() {
            "--fp16" => args.fp16 = true,
            "--with-cp" => args.with_cp = true,
            "--accumulate" => args.accumulate = number("--accumulate")?,
            "--epochs" => args.epochs = number("--epochs")?,
            other => {
                return Err(format!(
                    "unknown argument `{other}`: use --fp16, --accumulate K, --with-cp, --epochs N"
                ))
            }
        }
    }
    if !BATCH.is_multiple_of(args.accumulate) {
        return Err(format!(
            "--accumulate {} does not divide the batch of {BATCH}",
            args.accumulate
        ));
    }
    Ok(args)
}

fn run(args: Args) -> memsave::Result<()> {
    let device = Default::default();
    B::seed(&device, 42);
    let micro_batch = BATCH / args.accumulate;
    let train = DataLoaderBuilder::new(DigitBatcher)
        .batch_size(micro_batch)
        .shuffle(42)
        .build(Digits {
            len: TRAIN_SAMPLES,
            seed: 1,
        });
    let valid = DataLoaderBuilder::new(DigitBatcher)
        .batch_size(BATCH)
        .build(Digits {
            len: VALID_SAMPLES,
            seed: 2,
        });

    // Burn initialises weights lazily: materialised, the probe below and training share them.
    let mut model = memsave::check::materialise(Model::<B>::new(128, 0.1, &device));
    if args.with_cp {
        model = set_with_cp(model, true); // MMCV's with_cp=True: lives in the model
    }
    // The strategies, for the whole run; each is one call.
    let total_iters = args.epochs * TRAIN_SAMPLES.div_ceil(micro_batch);
    let strategies = || -> memsave::Result<Memsave> {
        let memsave = Memsave::new()
            .accumulate(args.accumulate, total_iters)?
            .clip_grad_norm(5.0)?;
        Ok(if args.fp16 {
            memsave.fp16(LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 1000)?)
        } else {
            memsave
        })
    };

    // What one micro-batch's forward and backward take above what was live before it (the
    // counting allocator), measured on a separate copy of the strategies.
    let step_peak = {
        let probe = strategies()?.model(model.clone())?;
        let items: Vec<DigitItem> = (0..micro_batch)
            .filter_map(|i| {
                Digits {
                    len: TRAIN_SAMPLES,
                    seed: 1,
                }
                .get(i)
            })
            .collect();
        let batch = DigitBatcher.batch(items, &device);
        let baseline = memsave::memory::reset_peak();
        let output = TrainStep::step(&probe, batch);
        let peak = memsave::memory::peak_bytes().saturating_sub(baseline);
        drop(output);
        peak
    };

    let memsave = strategies()?;
    // Was `Learner::new(model, optimizer, lr)`.
    let learner = memsave.learner(model, AdamConfig::new().init(), 1e-3)?;

    let dir = std::env::temp_dir().join(format!("memsave-burn-train-{}", std::process::id()));
    let training = SupervisedTraining::new(&dir, train, valid)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        // memsave's own: the loss scale, skipped steps, the place in the group, the grad norm.
        .metrics(memsave.metrics())
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        .with_application_logger(None)
        .renderer(Quiet)
        .num_epochs(args.epochs)
        .summary();

    println!(
        "Burn's guide classifier on synthetic digits: {} epochs of {TRAIN_SAMPLES} samples, {} \
         micro-batches of {micro_batch} per step, {}{}",
        args.epochs,
        args.accumulate,
        if args.fp16 {
            "f16 (dynamic loss scale)"
        } else {
            "fp32"
        },
        if args.with_cp {
            ", convolutions recomputed in backward"
        } else {
            ""
        },
    );
    let started = Instant::now();
    let result = training.launch(learner);
    let seconds = started.elapsed().as_secs_f64();

    // The final model on the validation split, counted here.
    let model = result.model;
    let mut correct = 0usize;
    let batcher = DigitBatcher;
    let items: Vec<DigitItem> = (0..VALID_SAMPLES)
        .filter_map(|i| {
            Digits {
                len: VALID_SAMPLES,
                seed: 2,
            }
            .get(i)
        })
        .collect();
    for chunk in items.chunks(BATCH) {
        let batch: DigitBatch<Flex> = batcher.batch(chunk.to_vec(), &Default::default());
        let predicted = model.forward(batch.images).argmax(1).flatten::<1>(0, 1);
        correct += predicted
            .equal(batch.targets)
            .int()
            .sum()
            .into_scalar()
            .elem::<i64>() as usize;
    }
    println!(
        "{} optimizer steps in {seconds:.1} s; held-out accuracy {:.1}%; a micro-batch's forward \
         and backward: {:.2} MiB above the weights and state{}",
        memsave.iterations().div_ceil(args.accumulate),
        100.0 * correct as f64 / VALID_SAMPLES as f64,
        memsave::memory::mib(step_peak),
        match memsave.loss_scale() {
            Some(scale) => format!("; loss scale {scale}"),
            None => String::new(),
        }
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn main() {
    let args = match args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("burn_train: {message}");
            std::process::exit(2);
        }
    };
    if let Err(error) = run(args) {
        eprintln!("burn_train: {error}");
        std::process::exit(1);
    }
}
