//! memsave's strategies in Burn's own loop (burn-train's `Learner` and `SupervisedTraining`):
//! a model trained there with mixed precision, accumulation and global-norm clipping equals the
//! same model, data order and seed trained through memsave's `Runner` (loss sequence and final
//! weights within 1e-6 in fp32; within the AMP tolerance in f16, overflow skips included), and
//! Burn's own checkpoints resume the loss scaler, the group count and the schedule.

use crate::common;

use std::cell::RefCell;
use std::path::Path;
use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::lr_scheduler::linear::{LinearLrScheduler, LinearLrSchedulerConfig};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use burn::train::checkpoint::KeepLastNCheckpoints;
use burn::train::{ClassificationOutput, InferenceStep, SupervisedTraining};
use memsave::burn_train::{ForwardStep, Memsave};
use memsave::fp16::{Fp16, Precision};
use memsave::hooks::{GradClip, Groups, OptimizerHook};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{
    DataSource, Hook, OptimizerKind, OptimizerSpec, Priority, RunLength, Runner, TrainModel,
    TrainState, WeightDtype, WeightRounding, WeightSpec,
};
use memsave::{auto_fp16, force_fp32};

type AD = Autodiff<Flex>;

const FEATURES: usize = 16;
const CLASSES: usize = 4;
const BATCH: usize = 2;
/// Samples per epoch: 6 batches.
const SAMPLES: usize = 12;
/// The fp16 tolerance of memsave's AMP tests (tests/suite/burn_layers.rs).
const F16_TOLERANCE: f32 = 1e-2;

thread_local! {
    /// The training losses of the current run, in order (burn-train runs the step on the
    /// calling thread).
    static LOSSES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn record_loss<B: Backend>(loss: &Tensor<B, 1>) {
    let value = loss.clone().cast(DType::F32).into_scalar().elem::<f32>();
    LOSSES.with(|losses| losses.borrow_mut().push(value));
}

fn take_losses() -> Vec<f32> {
    LOSSES.with(|losses| std::mem::take(&mut *losses.borrow_mut()))
}

/// A two-layer classifier; half inside under mixed precision, the loss in fp32.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Net<B> {
    fn new(device: &B::Device) -> Self {
        Net {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16(apply_to = (x))]
    fn logits(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2
            .forward(burn::tensor::activation::relu(self.fc1.forward(x)))
    }

    #[force_fp32(args = (logits))]
    fn loss(&self, logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets)
    }

    fn classify(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        let logits = self.logits(batch.x);
        let loss = self.loss(logits.clone(), batch.y.clone());
        ClassificationOutput::new(loss, logits.cast(DType::F32), batch.y)
    }
}

/// burn-train's side: the forward of the step (the backward is memsave's).
impl<B: AutodiffBackend> ForwardStep for Net<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn forward_step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        let output = self.classify(batch);
        record_loss(&output.loss);
        output
    }
}

impl<B: Backend> InferenceStep for Net<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}

/// memsave's runner's side: the same forward.
impl TrainModel<AD> for Net<AD> {
    type Batch = Batch<AD>;

    fn loss(&self, batch: Batch<AD>) -> Tensor<AD, 1> {
        let loss = self.classify(batch).loss;
        record_loss(&loss);
        loss
    }
}

#[derive(Clone, Debug)]
pub struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
}

/// One sample: features and a class that depends on them.
#[derive(Clone, Debug)]
pub struct Item {
    x: Vec<f32>,
    y: i64,
}

fn items() -> Vec<Item> {
    let mut state = 7u64;
    (0..SAMPLES)
        .map(|i| {
            let y = (i % CLASSES) as i64;
            let x = (0..FEATURES)
                .map(|f| {
                    let noise = (common::splitmix64(&mut state) % 1000) as f32 / 1000.0 - 0.5;
                    noise + if f % CLASSES == y as usize { 1.5 } else { 0.0 }
                })
                .collect();
            Item { x, y }
        })
        .collect()
}

fn batch<B: Backend>(items: &[Item], device: &B::Device) -> Batch<B> {
    let x: Vec<f32> = items.iter().flat_map(|item| item.x.clone()).collect();
    let y: Vec<i64> = items.iter().map(|item| item.y).collect();
    Batch {
        x: Tensor::from_data(TensorData::new(x, [items.len(), FEATURES]), device),
        y: Tensor::from_data(TensorData::new(y, [items.len()]), device),
    }
}

#[derive(Clone)]
struct NetBatcher;

impl<B: Backend> Batcher<B, Item, Batch<B>> for NetBatcher {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
        batch(&items, device)
    }
}

/// The same batches, in the same order, for memsave's runner.
struct Data(Vec<Item>);

impl DataSource<AD, Batch<AD>> for Data {
    fn batches_per_epoch(&self) -> usize {
        self.0.len() / BATCH
    }

    fn batch(
        &self,
        _epoch: usize,
        index: usize,
        device: &burn::tensor::Device<AD>,
    ) -> memsave::Result<Batch<AD>> {
        Ok(batch(&self.0[index * BATCH..(index + 1) * BATCH], device))
    }
}

/// A learning rate per optimizer step from a list (the schedule burn-train's side steps).
struct GroupLr {
    lrs: Vec<f64>,
    cumulative_iters: usize,
}

impl Hook<AD, Net<AD>> for GroupLr {
    fn name(&self) -> &'static str {
        "group_lr"
    }

    fn before_iter(&mut self, state: &mut TrainState<AD, Net<AD>>) -> memsave::Result<()> {
        state.lr = self.lrs[state.iter / self.cumulative_iters];
        Ok(())
    }
}

/// The strategies of one comparison.
#[derive(Clone, Copy)]
struct Setup {
    cumulative_iters: usize,
    epochs: usize,
    /// `Some(init_scale)`: f16 with a dynamic scale.
    fp16: Option<f64>,
    max_norm: f64,
    /// The trainable weights in 16 bits.
    weights: Option<WeightSpec>,
}

impl Setup {
    fn total_iters(&self) -> usize {
        self.epochs * SAMPLES / BATCH
    }

    fn scaler(&self) -> Option<LossScaler> {
        self.fp16
            .map(|scale| LossScaler::new(scale, ScaleMode::Dynamic, 2.0, 1000).unwrap())
    }

    fn memsave(&self) -> Memsave {
        let mut memsave = Memsave::new()
            .accumulate(self.cumulative_iters, self.total_iters())
            .unwrap()
            .clip_grad_norm(self.max_norm)
            .unwrap();
        if let Some(scaler) = self.scaler() {
            memsave = memsave.fp16(scaler);
        }
        if let Some(weights) = self.weights {
            memsave = memsave.weights(weights).unwrap();
        }
        memsave
    }

    fn schedule(&self) -> LinearLrScheduler {
        LinearLrSchedulerConfig::new(1e-2, 2e-3, 4).init().unwrap()
    }
}

fn initial_model() -> Net<AD> {
    let device = Default::default();
    AD::seed(&device, 11);
    Net::<AD>::new(&device).map(&mut common::Materialise)
}

fn loaders() -> (
    Arc<dyn DataLoader<AD, Batch<AD>>>,
    Arc<dyn DataLoader<Flex, Batch<Flex>>>,
) {
    let train = DataLoaderBuilder::new(NetBatcher)
        .batch_size(BATCH)
        .build(InMemDataset::new(items()));
    let valid = DataLoaderBuilder::new(NetBatcher)
        .batch_size(BATCH)
        .build(InMemDataset::new(items()));
    (train, valid)
}

/// Trains through burn-train: `epochs` in all, resuming from epoch `resume`'s checkpoint when
/// given; checkpoints in `dir` every epoch.
fn through_burn_train(
    setup: Setup,
    memsave: &Memsave,
    model: Net<AD>,
    dir: &Path,
    resume: Option<usize>,
) -> Net<Flex> {
    let (train, valid) = loaders();
    let learner = memsave
        .learner(
            model,
            AdamConfig::new().with_epsilon(1e-8).init(),
            setup.schedule(),
        )
        .unwrap();
    let mut training = SupervisedTraining::new(dir, train, valid)
        .num_epochs(setup.epochs)
        .with_application_logger(None)
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        .with_checkpointing_strategy(KeepLastNCheckpoints::new(10));
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    training.launch(learner).model
}

/// Trains through memsave's runner with the same strategies; the last iteration's log too.
fn through_runner(setup: Setup, model: Net<AD>, dir: &Path) -> (Net<Flex>, Option<f64>) {
    let mut hook = OptimizerHook::new()
        .with_groups(Groups::new(setup.cumulative_iters).unwrap())
        .with_grad_clip(Some(GradClip::new(setup.max_norm, 2.0).unwrap()));
    if let Some(scaler) = setup.scaler() {
        hook = hook.with_mixed_precision(scaler, Precision::F16);
    }
    let mut schedule = setup.schedule();
    let steps = setup.total_iters().div_ceil(setup.cumulative_iters);
    let lrs = (0..steps).map(|_| schedule.step()).collect();
    let optimizer = OptimizerSpec::from(OptimizerKind::adam())
        .with_weights(setup.weights.unwrap_or(WeightSpec::FP32));
    let mut runner = Runner::new(
        model,
        optimizer,
        Box::new(hook),
        Data(items()),
        RunLength::Epochs(setup.epochs),
        dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook_at(
        Box::new(GroupLr {
            lrs,
            cumulative_iters: setup.cumulative_iters,
        }),
        Priority::VeryHigh,
    );
    runner.run().unwrap();
    let scale = runner.state().log.loss_scale;
    (runner.into_model().valid(), scale)
}

/// Every parameter, flattened, in the model's order.
fn weights<B: Backend, M: Module<B>>(model: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = param.val().cast(DType::F32).into_data();
            self.0.extend(values.to_vec::<f32>().unwrap());
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

fn max_abs_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// What [`compare`] found.
struct Comparison {
    /// The largest difference between the two loss sequences.
    losses: f32,
    /// The largest difference between the two final weights.
    weights: f32,
    /// The loss scale at the end: burn-train's, the runner's.
    scales: (Option<f64>, Option<f64>),
    /// How far burn-train's weights moved from the initial ones.
    moved: f32,
    memsave: Memsave,
}

/// Trains `setup` both ways.
fn compare(setup: Setup, name: &str) -> Comparison {
    let dir = common::fresh_dir("burn-train", name);
    // One draw of the initial weights (the backend's generator is shared by the tests running
    // beside this one), cloned for both runs.
    let model = initial_model();
    let start = weights(&model.valid());
    take_losses();
    let (runner_model, runner_scale) = through_runner(setup, model.clone(), &dir.join("runner"));
    let runner_losses = take_losses();
    let memsave = setup.memsave();
    let burn_model = through_burn_train(setup, &memsave, model, &dir.join("burn"), None);
    let burn_losses = take_losses();
    assert_eq!(runner_losses.len(), setup.total_iters());
    assert_eq!(burn_losses.len(), setup.total_iters());
    let moved = max_abs_difference(&weights(&burn_model), &start);
    let _ = std::fs::remove_dir_all(&dir);
    Comparison {
        losses: max_abs_difference(&burn_losses, &runner_losses),
        weights: max_abs_difference(&weights(&burn_model), &weights(&runner_model)),
        scales: (memsave.loss_scale(), runner_scale),
        moved,
        memsave,
    }
}

#[test]
fn burn_train_with_accumulation_and_clipping_equals_the_runner_in_fp32() {
    // 12 micro-batches in groups of 5: two full groups (the second across the epochs' border)
    // and a final partial group of 2, whose losses are halved (MMCV's loss factor).
    let setup = Setup {
        cumulative_iters: 5,
        epochs: 2,
        fp16: None,
        max_norm: 0.5,
        weights: None,
    };
    let found = common::watchdog(300, move || compare(setup, "fp32"));
    let (losses, weights) = (found.losses, found.weights);
    println!("fp32: loss difference {losses:e}, weight difference {weights:e}");
    assert!(losses <= 1e-6, "losses differ by {losses}");
    assert!(weights <= 1e-6, "weights differ by {weights}");
    assert!(found.moved > 1e-3, "the weights did not move");
}

/// bf16 weights (each rounding) through burn-train: the runner's bits, the weights bf16.
#[test]
fn burn_train_with_bf16_weights_equals_the_runner() {
    for rounding in [
        WeightRounding::Stochastic,
        WeightRounding::Nearest,
        WeightRounding::Kahan,
    ] {
        let setup = Setup {
            cumulative_iters: 2,
            epochs: 1,
            fp16: None,
            max_norm: 0.5,
            weights: Some(WeightSpec::new(WeightDtype::Bf16, rounding).with_seed(3)),
        };
        let found = common::watchdog(300, move || compare(setup, &format!("bf16-{rounding}")));
        assert_eq!(found.weights, 0.0, "{rounding}");
        assert_eq!(found.losses, 0.0, "{rounding}");
        assert!(found.moved > 1e-3, "{rounding}: the weights did not move");
        assert!(
            found.memsave.last_step().weights_unchanged.is_some(),
            "{rounding}"
        );
    }
}

#[test]
fn burn_train_in_fp16_skips_the_same_overflows_as_the_runner() {
    // From 2^20 the scaled loss overflows f16 in backward: the first steps are skipped and the
    // scale halves each time, on both sides, until it fits.
    let setup = Setup {
        cumulative_iters: 2,
        epochs: 3,
        fp16: Some(1048576.0),
        max_norm: 1.0,
        weights: None,
    };
    let found = common::watchdog(300, move || compare(setup, "fp16"));
    let (losses, weights) = (found.losses, found.weights);
    let (scale, runner_scale) = found.scales;
    println!(
        "f16: loss difference {losses:e}, weight difference {weights:e}, scale {scale:?} vs \
         {runner_scale:?}"
    );
    assert!(losses <= F16_TOLERANCE, "losses differ by {losses}");
    assert!(weights <= F16_TOLERANCE, "weights differ by {weights}");
    assert_eq!(scale, runner_scale);
    assert!(scale.unwrap() < 1048576.0, "no overflow lowered the scale");
    let warnings = found.memsave.warnings();
    assert!(
        warnings.iter().any(|w| w.contains("init_scale = 65536.0")),
        "no advice on the first overflow: {warnings:?}"
    );
    // The steps after the skipped ones trained.
    assert!(found.moved > 1e-3, "the weights did not move");
}

#[test]
fn burn_checkpoints_resume_the_scaler_the_groups_and_the_schedule() {
    // 3 epochs of 6 micro-batches in groups of 3, f16: uninterrupted, and 2 epochs then a new
    // process-like start that resumes from epoch 2's checkpoint.
    let setup = Setup {
        cumulative_iters: 3,
        epochs: 3,
        fp16: Some(1048576.0),
        max_norm: 1.0,
        weights: None,
    };
    common::watchdog(300, move || {
        let dir = common::fresh_dir("burn-train", "resume");
        // One draw of the initial weights, cloned for both runs.
        let start = initial_model();
        let whole = setup.memsave();
        let uninterrupted = through_burn_train(setup, &whole, start.clone(), &dir.join("a"), None);

        let first = setup.memsave();
        let two = Setup { epochs: 2, ..setup };
        // The first part is told the whole run's length: its groups are the same.
        let _ = through_burn_train(two, &first, start, &dir.join("b"), None);
        let scale_at_two = first.loss_scale();
        // A fresh start: a fresh model (other weights) and scaler, all restored from the files.
        let second = setup.memsave();
        let device = Default::default();
        AD::seed(&device, 99);
        let fresh = Net::<AD>::new(&device).map(&mut common::Materialise);
        let resumed = through_burn_train(setup, &second, fresh, &dir.join("b"), Some(2));
        assert_ne!(
            scale_at_two, setup.fp16,
            "the scale never moved before the checkpoint"
        );
        assert_eq!(second.iterations(), whole.iterations());
        assert_eq!(second.loss_scale(), whole.loss_scale());
        let difference = max_abs_difference(&weights(&resumed), &weights(&uninterrupted));
        println!("resume: weight difference {difference:e}");
        assert_eq!(
            difference, 0.0,
            "the resumed run differs from the uninterrupted one"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn the_scheduler_steps_once_per_optimizer_step_and_bad_values_are_errors() {
    let memsave = Memsave::new().accumulate(3, 7).unwrap();
    let mut scheduler =
        memsave.scheduler(LinearLrSchedulerConfig::new(1e-2, 1e-3, 3).init().unwrap());
    let mut reference = LinearLrSchedulerConfig::new(1e-2, 1e-3, 3).init().unwrap();
    let expected: Vec<f64> = (0..3).map(|_| reference.step()).collect();
    // burn-train steps the scheduler before each micro-batch; the optimizer counts them.
    let model = initial_model();
    let mut optimizer = memsave.optimizer(AdamConfig::new().init());
    let mut wrapped = memsave.model::<AD, _>(model).unwrap();
    let mut seen = Vec::new();
    for index in 0..7 {
        seen.push(scheduler.step());
        let item =
            burn::train::TrainStep::step(&wrapped, batch(&items()[..2], &Default::default()));
        wrapped = burn::optim::Optimizer::step(&mut optimizer, seen[index], wrapped, item.grads);
    }
    take_losses();
    let groups: Vec<f64> = [0, 0, 0, 1, 1, 1, 2].iter().map(|&g| expected[g]).collect();
    assert_eq!(seen, groups);
    assert!(memsave.last_step().stepped, "the final partial group steps");

    let zero = Memsave::new().accumulate(0, 10).unwrap_err().to_string();
    assert!(zero.contains("cumulative_iters"), "{zero}");
    let total = Memsave::new().accumulate(2, 0).unwrap_err().to_string();
    assert!(total.contains("total_iters"), "{total}");
    let norm = Memsave::new().clip_grad_norm(-1.0).unwrap_err().to_string();
    assert!(norm.contains("max_norm"), "{norm}");
    let half = memsave::fp16::wrap_fp16_model(initial_model(), Precision::F16);
    let error = Memsave::new()
        .fp16(LossScaler::default())
        .model::<AD, _>(half)
        .unwrap_err()
        .to_string();
    assert!(error.contains("already in half precision"), "{error}");
}

/// Trains through burn-train with memsave's metrics registered (or not); returns the model.
fn with_metrics(
    setup: Setup,
    memsave: &Memsave,
    model: Net<AD>,
    dir: &Path,
    register: bool,
) -> Net<Flex> {
    let (train, valid) = loaders();
    let learner = memsave
        .learner(
            model,
            AdamConfig::new().with_epsilon(1e-8).init(),
            setup.schedule(),
        )
        .unwrap();
    let mut training = SupervisedTraining::new(dir, train, valid)
        .num_epochs(setup.epochs)
        .with_application_logger(None);
    if register {
        training = training.metrics(memsave.metrics());
    }
    training.launch(learner).model
}

/// The values burn-train's file logger wrote for `metric` in `epoch`, in order.
fn logged(dir: &Path, epoch: usize, metric: &str) -> Vec<f64> {
    let file = dir
        .join("train")
        .join(format!("epoch-{epoch}"))
        .join(format!("{}.log", metric.replace(' ', "_")));
    let text = std::fs::read_to_string(&file)
        .unwrap_or_else(|error| panic!("{}: {error}", file.display()));
    text.lines()
        .map(|line| {
            let value = line.split(',').next().unwrap_or_default();
            value
                .trim()
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("{}: `{line}`", file.display()))
        })
        .collect()
}

#[test]
fn memsaves_metrics_reach_burn_trains_log_one_value_per_micro_batch() {
    // 2 epochs of 6 micro-batches in groups of 4, f16 from 2^20 (the first steps overflow).
    let setup = Setup {
        cumulative_iters: 4,
        epochs: 2,
        fp16: Some(1048576.0),
        max_norm: 1.0,
        weights: None,
    };
    common::watchdog(300, move || {
        let dir = common::fresh_dir("burn-train", "metrics");
        let memsave = setup.memsave();
        take_losses();
        with_metrics(setup, &memsave, initial_model(), &dir, true);
        let losses = take_losses();
        let places: Vec<f64> = [1, 2]
            .iter()
            .flat_map(|&epoch| logged(&dir, epoch, "memsave Micro-batch In Group"))
            .collect();
        assert_eq!(
            places,
            vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]
        );
        let logged_losses: Vec<f64> = [1, 2]
            .iter()
            .flat_map(|&epoch| logged(&dir, epoch, "memsave Loss"))
            .collect();
        assert_eq!(logged_losses.len(), losses.len());
        for (logged, loss) in logged_losses.iter().zip(&losses) {
            assert!(
                (logged - *loss as f64).abs() <= 1e-6 * loss.abs() as f64,
                "{logged} vs {loss}"
            );
        }
        let scales: Vec<f64> = [1, 2]
            .iter()
            .flat_map(|&epoch| logged(&dir, epoch, "memsave Loss Scale"))
            .collect();
        let skipped: Vec<f64> = [1, 2]
            .iter()
            .flat_map(|&epoch| logged(&dir, epoch, "memsave Skipped Steps"))
            .collect();
        println!("loss scale per micro-batch {scales:?}, skipped steps {skipped:?}");
        // The scale holds within a group and halves at each skipped step's end.
        assert_eq!(scales.last().copied(), memsave.loss_scale());
        let overflows = memsave
            .warnings()
            .iter()
            .filter(|w| w.contains("gradient overflow"))
            .count();
        assert!(overflows > 0, "no overflow from 2^20");
        assert_eq!(skipped.last().copied(), Some(overflows as f64));
        for (i, pair) in skipped.windows(2).enumerate() {
            if pair[1] > pair[0] {
                assert_eq!(
                    (i + 1) % 4,
                    3,
                    "a skip at micro-batch {} is not a group's end",
                    i + 1
                );
                assert_eq!(scales[i + 1], scales[i] / 2.0);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn accumulate_auto_learns_the_runs_length_from_burn_trains_progress() {
    // 12 micro-batches in groups of 5: the final group has 2, and is divided by 2 only if the
    // run's length is known. `accumulate_auto` learns it from burn-train (2 epochs of 6).
    let setup = Setup {
        cumulative_iters: 5,
        epochs: 2,
        fp16: None,
        max_norm: 0.5,
        weights: None,
    };
    common::watchdog(300, move || {
        let dir = common::fresh_dir("burn-train", "auto");
        let model = initial_model();
        let told = with_metrics(
            setup,
            &setup.memsave(),
            model.clone(),
            &dir.join("told"),
            true,
        );
        let auto = Memsave::new()
            .accumulate_auto(5)
            .unwrap()
            .clip_grad_norm(0.5)
            .unwrap();
        let learnt = with_metrics(setup, &auto, model.clone(), &dir.join("auto"), true);
        let last = auto.last_step();
        assert_eq!((last.micro_batch, last.group_size), (2, 2), "{last:?}");
        assert!(last.stepped, "{last:?}");
        assert_eq!(weights(&learnt), weights(&told));
        // Without memsave's metrics it cannot learn: it says so, and the final group is divided
        // by 5.
        let blind = Memsave::new()
            .accumulate_auto(5)
            .unwrap()
            .clip_grad_norm(0.5)
            .unwrap();
        let unlearnt = with_metrics(setup, &blind, model, &dir.join("blind"), false);
        assert!(
            blind
                .warnings()
                .iter()
                .any(|w| w.contains("memsave.metrics()")),
            "{:?}",
            blind.warnings()
        );
        assert!(max_abs_difference(&weights(&unlearnt), &weights(&told)) > 0.0);
        let _ = std::fs::remove_dir_all(&dir);
    });
}
