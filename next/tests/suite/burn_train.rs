//! memsave's strategies in burn-train 0.22's Learner (issue 55, item 3): mixed precision with
//! loss scaling, MMCV's averaged accumulation with a final partial group, global-norm clipping
//! and checkpointed blocks train the weights a hand-written loop of the same rules trains; the
//! scheduler steps once per optimizer step; an error of memsave's stops the training and reaches
//! the user whatever the program does.

use crate::common;

use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, GradientsParams, LearningRate, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;
use burn::train::{InferenceStep, RegressionOutput, SupervisedTraining};
use common::{param_bits, watchdog};
use memsave_macros::{auto_fp16, model, with_cp};
use memsave_next::burn_train::{ForwardStep, Memsave};
use memsave_next::checkpoint::set_with_cp;
use memsave_next::fp16::{wrap_fp16_model, Fp16, Precision};
use memsave_next::scaler::{LossScaler, ScaleMode};

#[model]
#[derive(Module, Debug)]
struct Block {
    fc: Linear,
    with_cp: bool,
    fp16_enabled: Fp16,
}

impl Block {
    #[with_cp]
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        burn::tensor::activation::relu(self.fc.forward(x))
    }
}

#[model]
#[derive(Module, Debug)]
struct Net {
    input: Linear,
    #[with_cp]
    blocks: Vec<Block>,
    output: Linear,
    fp16_enabled: Fp16,
}

#[derive(Clone, Debug)]
struct Item {
    x: Vec<f32>,
    y: Vec<f32>,
}

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<2>,
}

const IN: usize = 6;
const OUT: usize = 3;

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            input: LinearConfig::new(IN, 16).init(device),
            blocks: (0..2)
                .map(|_| Block {
                    fc: LinearConfig::new(16, 16).init(device),
                    with_cp: false,
                    fp16_enabled: Fp16::Off,
                })
                .collect(),
            output: LinearConfig::new(16, OUT).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16(out_fp32 = true)]
    fn predict(&self, x: Tensor<2>) -> Tensor<2> {
        let x = self.input.forward(x);
        let x = self.blocks.iter().fold(x, |x, block| block.forward(x));
        self.output.forward(x)
    }
}

/// The mean squared error of `output` against the batch's targets, as burn-train's output.
fn regression(output: Tensor<2>, targets: Tensor<2>) -> RegressionOutput {
    let loss = (output.clone() - targets.clone()).powi_scalar(2).mean();
    RegressionOutput {
        loss,
        output,
        targets,
    }
}

/// memsave's forward step and burn-train's validation step of a model whose `predict` maps a
/// batch's inputs to its outputs: the mean squared error against the targets.
macro_rules! regression_steps {
    ($($model:ty),*) => {$(
        impl $model {
            fn regression(&self, batch: Batch) -> RegressionOutput {
                regression(self.predict(batch.x), batch.y)
            }
        }

        impl ForwardStep for $model {
            type Input = Batch;
            type Output = RegressionOutput;

            fn forward_step(&self, batch: Batch) -> RegressionOutput {
                self.regression(batch)
            }
        }

        impl InferenceStep for $model {
            type Input = Batch;
            type Output = RegressionOutput;

            fn step(&self, batch: Batch) -> RegressionOutput {
                self.regression(batch)
            }
        }
    )*};
}

regression_steps!(Net, Trap);

#[derive(Clone)]
struct ItemBatcher;

impl Batcher<Item, Batch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let rows = items.len();
        let x: Vec<f32> = items.iter().flat_map(|item| item.x.clone()).collect();
        let y: Vec<f32> = items.iter().flat_map(|item| item.y.clone()).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [rows, IN]), device),
            y: Tensor::from_data(TensorData::new(y, [rows, OUT]), device),
        }
    }
}

/// `n` items of a fixed pattern (no random stream), the inputs scaled by `scale`.
fn items(n: usize, scale: f32) -> Vec<Item> {
    let value = |i: usize, salt: usize| (((i + salt) * 37 % 29) as f32 / 29.0 - 0.5) * scale;
    (0..n)
        .map(|row| Item {
            x: (0..IN).map(|j| value(row * IN + j, 3)).collect(),
            y: (0..OUT).map(|j| value(row * OUT + j, 11)).collect(),
        })
        .collect()
}

fn loader(items: Vec<Item>, batch: usize) -> Arc<dyn DataLoader<Batch>> {
    DataLoaderBuilder::new(ItemBatcher)
        .batch_size(batch)
        .set_device(common::device())
        .build(InMemDataset::new(items))
}

fn dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "memsave-next-burn-train-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A fresh model, every block checkpointed.
fn net() -> Net {
    let device = common::device();
    device.seed(21);
    set_with_cp(Net::new(&device), true)
}

/// What the hand-written loop and the Learner share.
struct Setup {
    precision: Option<Precision>,
    /// The weights themselves in `precision` (16-bit weights, `Weights16` with AdamW).
    weights16: bool,
    loss_scale: f64,
    cumulative: usize,
    clip: Option<f64>,
    epochs: usize,
    samples: usize,
    batch: usize,
    scale: f32,
}

impl Setup {
    fn iters(&self) -> usize {
        self.epochs * self.samples.div_ceil(self.batch)
    }

    fn memsave(&self) -> Memsave {
        let mut memsave = Memsave::new();
        if let Some(precision) = self.precision {
            let scaler = LossScaler::new(self.loss_scale, ScaleMode::Dynamic, 2.0, 3).unwrap();
            memsave = match self.weights16 {
                true => memsave.weights16(precision, Some(scaler)),
                false => memsave.mixed_precision(scaler, precision),
            };
        }
        memsave = memsave.accumulate(self.cumulative, self.iters()).unwrap();
        if let Some(clip) = self.clip {
            memsave = memsave.clip_grad_norm(clip).unwrap();
        }
        memsave
    }

    fn optimizer(&self) -> burn::optim::ModuleOptimizer {
        match self.weights16 {
            true => memsave_next::weights16::Weights16::new(AdamWConfig::new().build()).init(),
            false => sgd(),
        }
    }
}

fn sgd() -> burn::optim::ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

const LR: f64 = 0.05;

fn through_burn_train(setup: &Setup, name: &str) -> (Net, Memsave) {
    let memsave = setup.memsave();
    let learner = memsave.learner(net(), setup.optimizer(), LR).unwrap();
    let result = SupervisedTraining::new(
        dir(name),
        loader(items(setup.samples, setup.scale), setup.batch),
        loader(items(4, setup.scale), 2),
    )
    .with_interrupter(memsave.interrupter())
    .num_epochs(setup.epochs)
    .launch(learner);
    assert!(
        result.error.is_none(),
        "{:?}",
        result.error.map(|e| e.to_string())
    );
    memsave.finish().unwrap();
    (result.model.into_model(), memsave)
}

/// The same rules written out: each micro-batch's loss divided by its group's size, then
/// multiplied by the scale (MMCV's order), its gradients added to fp32 sums; at a group's end the sums unscaled,
/// an inf or NaN skipping the step (the scale halved), clipping by the global 2-norm, SGD.
fn by_hand(setup: &Setup) -> (Net, f64, usize) {
    let mut masters = match (setup.weights16, setup.precision) {
        (true, Some(precision)) => wrap_fp16_model(net(), precision),
        _ => net(),
    };
    let mut optimizer = setup.optimizer();
    let mut scale = setup.precision.map_or(1.0, |_| setup.loss_scale);
    let mut clean = 0;
    let mut skipped = 0;
    let data = items(setup.samples, setup.scale);
    let total = setup.iters();
    let mut sums: Option<GradientsParams> = None;
    let mut iter = 0;
    for _ in 0..setup.epochs {
        for chunk in data.chunks(setup.batch) {
            let batch = ItemBatcher.batch(chunk.to_vec(), &common::device());
            let last_group = total - total % setup.cumulative;
            let factor = if iter < last_group {
                setup.cumulative
            } else {
                total % setup.cumulative
            } as f64;
            let forward = match setup.precision {
                Some(_) if setup.weights16 => masters.clone(),
                Some(precision) => wrap_fp16_model(masters.clone(), precision),
                None => masters.clone(),
            };
            let loss = forward.regression(batch).loss.cast(DType::F32);
            let loss = loss.div_scalar(factor).mul_scalar(scale);
            let grads = GradientsParams::from_grads(loss.backward(), &forward);
            sums = Some(add_f32(&masters, sums, grads));
            let ends = (iter + 1) % setup.cumulative == 0 || iter + 1 == total;
            iter += 1;
            if !ends {
                continue;
            }
            let mut grads = sums.take().unwrap();
            map(&masters, &mut grads, |g| g.mul_scalar(1.0 / scale));
            let norm = norm(&masters, &grads);
            if !norm.is_finite() {
                skipped += 1;
                scale /= 2.0;
                clean = 0;
                continue;
            }
            if let Some(max_norm) = setup.clip {
                let coefficient = max_norm / (norm + 1e-6);
                if coefficient < 1.0 {
                    map(&masters, &mut grads, |g| g.mul_scalar(coefficient));
                }
            }
            masters = optimizer.step(LR, masters, grads);
            if setup.precision.is_some() {
                clean += 1;
                if clean == 3 {
                    scale *= 2.0;
                    clean = 0;
                }
            }
        }
    }
    (masters, scale, skipped)
}

fn add_f32(
    model: &Net,
    sums: Option<GradientsParams>,
    mut grads: GradientsParams,
) -> GradientsParams {
    struct Add<'a>(&'a mut GradientsParams, &'a mut GradientsParams);
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.1.remove::<D>(param.id) {
                let grad = grad.cast(DType::F32);
                let sum = match self.0.remove::<D>(param.id) {
                    Some(sum) => sum + grad,
                    None => grad,
                };
                self.0.register::<D>(param.id, sum);
            }
        }
    }
    let mut sums = sums.unwrap_or_default();
    model.visit(&mut Add(&mut sums, &mut grads));
    sums
}

fn map(model: &Net, grads: &mut GradientsParams, f: impl Fn(Tensor<1>) -> Tensor<1>) {
    struct Map<'a, F>(&'a mut GradientsParams, F);
    impl<F: Fn(Tensor<1>) -> Tensor<1>> ModuleVisitor for Map<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.remove::<D>(param.id) {
                let shape = grad.shape();
                let flat: Tensor<1> = grad.reshape([shape.num_elements()]);
                self.0
                    .register::<D>(param.id, (self.1)(flat).reshape(shape));
            }
        }
    }
    model.visit(&mut Map(grads, f));
}

fn norm(model: &Net, grads: &GradientsParams) -> f64 {
    struct Sum<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.get::<D>(param.id) {
                self.1 += grad.powi_scalar(2).sum().into_scalar::<f64>();
            }
        }
    }
    let mut sum = Sum(grads, 0.0);
    model.visit(&mut sum);
    sum.1.sqrt()
}

fn relative_difference(a: &[Vec<u32>], b: &[Vec<u32>]) -> f64 {
    let values = |v: &[Vec<u32>]| -> Vec<f64> {
        v.iter()
            .flatten()
            .map(|bits| f32::from_bits(*bits) as f64)
            .collect()
    };
    let (a, b) = (values(a), values(b));
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(&b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

#[test]
fn the_learner_with_mixed_precision_accumulation_and_clipping_trains_what_the_rules_say() {
    watchdog(600, || {
        for (name, setup) in [
            (
                "fp32, groups of 4 with a final group of 2, clipped",
                Setup {
                    weights16: false,
                    precision: None,
                    loss_scale: 1.0,
                    cumulative: 4,
                    clip: Some(0.4),
                    epochs: 2,
                    samples: 10,
                    batch: 2,
                    scale: 2.0,
                },
            ),
            (
                "f16, the scale from 2^18 doubled after 3 clean steps until it overflows, groups of 3 with a final group of 1, clipped",
                Setup {
                    weights16: false,
                    precision: Some(Precision::F16),
                    loss_scale: 262144.0,
                    cumulative: 3,
                    clip: Some(0.4),
                    epochs: 2,
                    samples: 10,
                    batch: 2,
                    scale: 2.0,
                },
            ),
            (
                "bf16 weights as their only copy (Weights16 over AdamW, stochastic rounding), \
                 groups of 3, clipped",
                Setup {
                    weights16: true,
                    precision: Some(Precision::Bf16),
                    loss_scale: 1.0,
                    cumulative: 3,
                    clip: Some(0.4),
                    epochs: 2,
                    samples: 10,
                    batch: 2,
                    scale: 2.0,
                },
            ),
            (
                "bf16, groups of 2",
                Setup {
                    weights16: false,
                    precision: Some(Precision::Bf16),
                    loss_scale: 1.0,
                    cumulative: 2,
                    clip: None,
                    epochs: 1,
                    samples: 12,
                    batch: 3,
                    scale: 2.0,
                },
            ),
        ] {
            let (trained, memsave) = through_burn_train(&setup, "rules");
            let (expected, scale, skipped) = by_hand(&setup);
            let difference = relative_difference(&param_bits(&trained), &param_bits(&expected));
            let start = relative_difference(&param_bits(&net()), &param_bits(&expected));
            println!(
                "{name}: worst difference from the hand loop {difference:e} (relative to the \
                 largest weight; the start differs by {start:e}); {skipped} steps skipped, scale \
                 {scale}; memsave: {:?}",
                memsave.last_step()
            );
            assert!(start > 1e-3, "{name}: the training moved the weights");
            assert!(difference < 1e-6, "{name}: {difference}");
            assert_eq!(memsave.iterations(), setup.iters(), "{name}");
            if setup.precision.is_some() {
                assert_eq!(memsave.loss_scale(), Some(scale), "{name}");
                assert_eq!(memsave.last_step().skipped_steps, skipped, "{name}");
            }
            if name.starts_with("f16") {
                assert!(skipped > 0, "the f16 case overflows at its first scale");
            }
            let master = trained.input.weight.val().dtype();
            match setup.weights16 {
                true => assert_eq!(master, DType::BF16, "{name}: the weights stay bf16"),
                false => assert_eq!(master, DType::F32, "{name}: the masters stay fp32"),
            }
            // The last step's share of updates the 16-bit weights left unchanged, with them
            // alone.
            let share = memsave.last_step().weights_unchanged;
            assert_eq!(share.is_some(), setup.weights16, "{name}: {share:?}");
            assert!(share.is_none_or(|share| (0.0..1.0).contains(&share)), "{name}");
        }
    });
}

/// A run of `epochs` (6 micro-batches each) with burn-train's default checkpointers in `dir`,
/// resumed from epoch `resume` where given: f16 with a dynamic scale that doubles every 3 steps
/// (2^10 at the start, 2^11 at the checkpoint, 2^12 at the end), groups of 3, clipping, and a
/// linear schedule (its state is burn-train's too).
fn checkpointed_run(dir: &std::path::Path, epochs: usize, resume: Option<usize>) -> (Net, Memsave) {
    let memsave = Memsave::new()
        .fp16(LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 3).unwrap())
        .accumulate(3, epochs * 6)
        .unwrap()
        .clip_grad_norm(0.4)
        .unwrap();
    let schedule = burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig::new(0.05, 0.01, 10)
        .init()
        .unwrap();
    let learner = memsave.learner(net(), sgd(), schedule).unwrap();
    let mut training =
        SupervisedTraining::new(dir, loader(items(12, 2.0), 2), loader(items(4, 2.0), 2))
            .with_default_checkpointers()
            .with_interrupter(memsave.interrupter())
            .num_epochs(epochs);
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    let result = training.launch(learner);
    assert!(
        result.error.is_none(),
        "{:?}",
        result.error.map(|e| e.to_string())
    );
    memsave.finish().unwrap();
    (result.model.into_model(), memsave)
}

#[test]
fn burn_trains_checkpoints_resume_the_scaler_the_groups_and_the_schedule() {
    watchdog(600, || {
        let dir = dir("resume");
        let (straight, whole) = checkpointed_run(&dir, 3, None);
        let (resumed, memsave) = checkpointed_run(&dir, 3, Some(2));
        println!(
            "uninterrupted: {:?}, scale {:?}; resumed at epoch 2: {:?}, scale {:?}; warnings {:?}",
            whole.last_step(),
            whole.loss_scale(),
            memsave.last_step(),
            memsave.loss_scale(),
            memsave.warnings()
        );
        assert_eq!(param_bits(&resumed), param_bits(&straight), "bit for bit");
        assert_eq!(memsave.loss_scale(), whole.loss_scale());
        assert_eq!(memsave.iterations(), 18);
        assert_eq!(whole.loss_scale(), Some(4096.0), "the scale moved");
        assert_eq!(
            memsave.last_step().skipped_steps,
            whole.last_step().skipped_steps
        );
    });
}

/// The values burn-train's file logger wrote for `metric` in `epoch`, one per micro-batch, in
/// order.
fn logged(dir: &std::path::Path, epoch: usize, metric: &str) -> Vec<f64> {
    let file = dir
        .join("train")
        .join(format!("epoch-{epoch}"))
        .join(format!("{}.log", metric.replace(' ', "_")));
    let text = std::fs::read_to_string(&file)
        .unwrap_or_else(|error| panic!("{}: {error}", file.display()));
    // burn-train 0.22 ends each epoch's file with the epoch's aggregate (`value,final`).
    text.lines()
        .filter(|line| !line.ends_with(",final"))
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
    watchdog(300, || {
        let dir = dir("metrics");
        // 2 epochs of 6 micro-batches in groups of 4; f16 from 2^18, doubling after 3 steps.
        let memsave = Memsave::new()
            .fp16(LossScaler::new(262144.0, ScaleMode::Dynamic, 2.0, 3).unwrap())
            .accumulate(4, 12)
            .unwrap();
        let learner = memsave.learner(net(), sgd(), LR).unwrap();
        let result =
            SupervisedTraining::new(&dir, loader(items(12, 2.0), 2), loader(items(4, 2.0), 2))
                .metrics(memsave.metrics())
                .num_epochs(2)
                .launch(learner);
        assert!(result.error.is_none());
        memsave.finish().unwrap();
        let both = |metric: &str| -> Vec<f64> {
            [1, 2]
                .iter()
                .flat_map(|&epoch| logged(&dir, epoch, metric))
                .collect()
        };
        let places = both("memsave Micro-batch In Group");
        assert_eq!(places, [1., 2., 3., 4.].repeat(3));
        let losses = both("memsave Loss");
        assert_eq!(losses.len(), 12);
        // The first is the loss of the first batch on the half copy of the starting weights.
        let first = wrap_fp16_model(net(), Precision::F16)
            .regression(ItemBatcher.batch(items(2, 2.0), &common::device()))
            .loss
            .into_scalar::<f64>();
        assert!(
            (losses[0] - first).abs() <= 1e-4 * first.abs(),
            "{} vs {first}",
            losses[0]
        );
        let scales = both("memsave Loss Scale");
        let skipped = both("memsave Skipped Steps");
        let norms = both("memsave Grad Norm");
        println!("losses {losses:?}\nscales {scales:?}\nskipped {skipped:?}\nnorms {norms:?}");
        assert_eq!(scales.last().copied(), memsave.loss_scale());
        assert_eq!(
            skipped.last().copied(),
            Some(memsave.last_step().skipped_steps as f64)
        );
        // The scale holds within a group and changes at a group's end only.
        for (i, pair) in scales.windows(2).enumerate() {
            if pair[0] != pair[1] {
                // Micro-batch i + 1 shows the scale after its step: it ends a group.
                assert_eq!(
                    (i + 2) % 4,
                    0,
                    "the scale changed inside a group at {}",
                    i + 1
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn registering_memsaves_metrics_hands_it_the_interrupter() {
    watchdog(300, || {
        let memsave = Memsave::new();
        let learner = memsave
            .learner(Trap::new(&common::device()), sgd(), LR)
            .unwrap();
        let result = trap_training("trap-metrics")
            .metrics(memsave.metrics())
            .launch(learner);
        let said = result
            .error
            .expect("the training stopped with the error")
            .to_string();
        assert!(said.contains("`Unmarked`"), "{said}");
        assert!(memsave.finish().is_err());
    });
}

#[test]
fn every_parameter_groups_rate_reaches_the_step() {
    watchdog(300, || {
        use burn::module::ParamGroup;
        use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
        let start = net();
        // The output layer in a group of its own, at rate 0: it must not move.
        let schedule = ModuleLrScheduler::new(0.05)
            .with_group(ParamGroup::ids_from_module(start.output.clone()), 0.0);
        let memsave = Memsave::new().accumulate(2, 6).unwrap();
        let learner = memsave.learner(start.clone(), sgd(), schedule).unwrap();
        let result = SupervisedTraining::new(
            dir("groups"),
            loader(items(12, 2.0), 2),
            loader(items(4, 2.0), 2),
        )
        .num_epochs(1)
        .launch(learner);
        assert!(result.error.is_none());
        memsave.finish().unwrap();
        let trained = result.model.into_model();
        assert_eq!(param_bits(&trained.output), param_bits(&start.output));
        assert_ne!(param_bits(&trained.input), param_bits(&start.input));
    });
}

#[test]
fn the_schedulers_record_is_a_plain_runs_and_keeps_the_groups_rate() {
    // Under the watchdog: it makes models, which draw from Flex's one random stream.
    watchdog(120, || {
        use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
        use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
        let linear = || LinearLrSchedulerConfig::new(0.1, 0.01, 10).init().unwrap();
        // memsave's scheduler as the Learner holds it, stepped for micro-batches 0 to 4 in groups
        // of 3 (the inner scheduler stepped twice: at 0 and at 3).
        let memsave = Memsave::new().accumulate(3, 30).unwrap();
        let mut model = memsave.model(net()).unwrap();
        let mut ours = ModuleLrScheduler::new(memsave.scheduler(linear()));
        let mut plain = linear();
        let mut rates = Vec::new();
        for _ in 0..2 {
            rates.push(plain.step().base());
        }
        // Drive memsave's count of micro-batches as the Learner would: a step each.
        for iter in 0..5 {
            let rate = ours.step().base();
            assert_eq!(rate, rates[iter / 3], "micro-batch {iter}");
            model = advance(model);
        }
        let record = ours.to_record();
        // Into a plain run: the user's schedule goes on where it was.
        let mut into_plain = linear().load_record(record.clone());
        assert_eq!(into_plain.step().base(), plain.clone().step().base());
        // Into memsave's, inside the group: the group's rate, then the next step's.
        let resumed = Memsave::new().accumulate(3, 30).unwrap();
        let model = resumed.model(net()).unwrap();
        let mut theirs = ModuleLrScheduler::new(resumed.scheduler(linear())).load_record(record);
        assert_eq!(resumed.iterations(), 5);
        assert_eq!(
            theirs.step().base(),
            rates[1],
            "micro-batch 5 is in the group of 3..6"
        );
        let _ = advance(model);
        assert_eq!(
            theirs.step().base(),
            plain.step().base(),
            "micro-batch 6 starts a group"
        );
    });
}

#[test]
fn a_resume_keeps_every_groups_schedule_behind_a_group_without_state() {
    use burn::module::{ParamGroup, ParamId};
    use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
    watchdog(120, || {
        let (constant, scheduled) = (ParamId::new(), ParamId::new());
        // Group 1 a constant rate (a scheduler without state), group 2 one that counts.
        let schedule = || {
            ModuleLrScheduler::new(0.1)
                .with_group(ParamGroup::from_ids(vec![constant]), 0.5)
                .with_group(ParamGroup::from_ids(vec![scheduled]), Stepped(0))
        };
        let memsave = Memsave::new();
        let mut model = memsave.model(net()).unwrap();
        let mut ours = ModuleLrScheduler::new(memsave.scheduler(schedule()));
        for _ in 0..3 {
            ours.step();
            model = advance(model);
        }
        let resumed = Memsave::new();
        let mut theirs =
            ModuleLrScheduler::new(resumed.scheduler(schedule())).load_record(ours.to_record());
        let mut straight = schedule();
        for _ in 0..3 {
            straight.step();
        }
        theirs.step();
        let rates = resumed.learning_rates().expect("stepped");
        let expected = straight.step();
        for id in [constant, scheduled] {
            assert_eq!(
                rates.lr_from_param(id, None),
                expected.lr_from_param(id, None)
            );
        }
        drop(model);
    });
}

/// A scheduler with state: `0.01 * steps`, its count in its record.
#[derive(Clone)]
struct Stepped(u64);

impl LrScheduler for Stepped {
    fn step(&mut self) -> LearningRate {
        self.0 += 1;
        0.01 * self.0 as f64
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar("steps", self.0)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        self.0 = record.scalar::<u64>("steps").unwrap_or(0);
    }
}

/// `model` after the optimizer saw one more micro-batch (no gradients): how the Learner moves
/// memsave's count on.
fn advance(
    model: memsave_next::burn_train::MemsaveModel<Net>,
) -> memsave_next::burn_train::MemsaveModel<Net> {
    use burn::train::TrainStep;
    model.optimize(&mut sgd(), 0.0.into(), GradientsParams::new())
}

/// A transformer of Burn's own encoder layers (dropout 0.25), each a `#[with_cp]` block, with
/// the layers' recomputations counted.
#[model]
#[derive(Module, Debug)]
struct EncoderBlock {
    layer: burn::nn::transformer::TransformerEncoderLayer,
    with_cp: bool,
    fp16_enabled: Fp16,
}

static BLOCK_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl EncoderBlock {
    #[with_cp]
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        BLOCK_RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.layer.forward(x, None, None)
    }
}

const SEQ: usize = 4;

#[model]
#[derive(Module, Debug)]
struct Encoder {
    embed: Linear,
    #[with_cp]
    blocks: Vec<EncoderBlock>,
    head: Linear,
    fp16_enabled: Fp16,
}

impl Encoder {
    fn new(device: &Device) -> Self {
        device.seed(8);
        let config =
            burn::nn::transformer::TransformerEncoderConfig::new(16, 32, 2, 3).with_dropout(0.25);
        Encoder {
            embed: LinearConfig::new(IN, 16).init(device),
            blocks: config
                .init(device)
                .layers
                .into_iter()
                .map(|layer| EncoderBlock {
                    layer,
                    with_cp: false,
                    fp16_enabled: Fp16::Off,
                })
                .collect(),
            head: LinearConfig::new(16, OUT).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    /// Each row's `IN` features repeated over `SEQ` positions (scaled by the position), the mean
    /// over positions of the head's outputs.
    #[auto_fp16(out_fp32 = true)]
    fn predict(&self, x: Tensor<2>) -> Tensor<2> {
        let [rows, _] = x.dims();
        let positions = Tensor::<1, Int>::arange(1..SEQ as i64 + 1, &x.device())
            .float()
            .cast(x.dtype())
            .reshape([1, SEQ, 1]);
        let x = x.reshape([rows, 1, IN]).repeat_dim(1, SEQ) * positions.div_scalar(SEQ as f64);
        let h = self.embed.forward(x);
        let h = self.blocks.iter().fold(h, |h, block| block.forward(h));
        self.head.forward(h).mean_dim(1).reshape([rows, OUT])
    }
}

regression_steps!(Encoder);

#[test]
fn a_transformer_trains_through_the_learner_in_f16_with_every_block_checkpointed_exactly() {
    watchdog(600, || {
        let train = |checkpointed: bool, name: &str| {
            let memsave = Memsave::new()
                .fp16(LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2).unwrap())
                .accumulate(2, 2 * 5)
                .unwrap()
                .clip_grad_norm(1.0)
                .unwrap();
            let model = set_with_cp(Encoder::new(&common::device()), checkpointed);
            let start = param_bits(&model);
            let learner = memsave
                .learner(model, AdamWConfig::new().init(), 1e-3)
                .unwrap();
            BLOCK_RUNS.store(0, std::sync::atomic::Ordering::Relaxed);
            common::device().seed(3);
            let result = SupervisedTraining::new(
                dir(name),
                loader(items(10, 2.0), 2),
                loader(items(4, 2.0), 2),
            )
            .with_interrupter(memsave.interrupter())
            .num_epochs(2)
            .launch(learner);
            assert!(
                result.error.is_none(),
                "{:?}",
                result.error.map(|e| e.to_string())
            );
            memsave.finish().unwrap();
            let runs = BLOCK_RUNS.load(std::sync::atomic::Ordering::Relaxed);
            let trained = result.model.into_model();
            assert_ne!(param_bits(&trained), start, "it trained");
            (param_bits(&trained), runs, memsave.loss_scale())
        };
        let (plain, plain_runs, plain_scale) = train(false, "encoder-plain");
        let (checkpointed, runs, scale) = train(true, "encoder-checkpointed");
        println!(
            "encoder blocks ran {plain_runs} times plain and {runs} checkpointed (10 training \
             micro-batches and 4 validation batches of 2 epochs, 3 blocks); loss scale \
             {plain_scale:?} and {scale:?}"
        );
        assert_eq!(checkpointed, plain, "bit for bit");
        assert_eq!(scale, plain_scale);
        // Each training micro-batch runs each block twice when checkpointed (the forward and
        // the recomputation), once plainly; validation runs them once either way.
        assert_eq!(runs - plain_runs, 2 * 5 * 3);
    });
}

/// A scheduler that counts its steps and gives `0.01 * steps`.
#[derive(Clone)]
struct Counting(Arc<Mutex<usize>>);

impl LrScheduler for Counting {
    fn step(&mut self) -> LearningRate {
        let mut steps = self.0.lock().unwrap();
        *steps += 1;
        0.01 * *steps as f64
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new()
    }

    fn load_record(&mut self, _record: LrSchedulerRecord) {}
}

#[test]
fn the_scheduler_steps_once_per_optimizer_step() {
    watchdog(300, || {
        let steps = Arc::new(Mutex::new(0));
        let memsave = Memsave::new().accumulate(3, 2 * 5).unwrap();
        let learner = memsave
            .learner(net(), sgd(), Counting(steps.clone()))
            .unwrap();
        let result = SupervisedTraining::new(
            dir("schedule"),
            loader(items(10, 1.0), 2),
            loader(items(4, 1.0), 2),
        )
        .num_epochs(2)
        .launch(learner);
        assert!(result.error.is_none());
        memsave.finish().unwrap();
        // Ten micro-batches in groups of 3, 3, 3 and 1: four optimizer steps.
        assert_eq!(*steps.lock().unwrap(), 4);
        assert_eq!(memsave.iterations(), 10);
    });
}

/// A block whose forward is not `#[with_cp]`, in a model that switches it on.
#[model]
#[derive(Module, Debug)]
struct Unmarked {
    fc: Linear,
    with_cp: bool,
    fp16_enabled: Fp16,
}

#[model]
#[derive(Module, Debug)]
struct Trap {
    #[with_cp]
    block: Unmarked,
    fp16_enabled: Fp16,
}

impl Trap {
    fn new(device: &Device) -> Self {
        let block = Unmarked {
            fc: LinearConfig::new(IN, OUT).init(device),
            with_cp: true,
            fp16_enabled: Fp16::Off,
        };
        Trap {
            block,
            fp16_enabled: Fp16::Off,
        }
    }

    fn predict(&self, x: Tensor<2>) -> Tensor<2> {
        self.block.fc.forward(x)
    }
}

fn trap_training(name: &str) -> SupervisedTraining<memsave_next::burn_train::MemsaveModel<Trap>> {
    SupervisedTraining::new(
        dir(name),
        loader(items(8, 1.0), 2),
        loader(items(4, 1.0), 2),
    )
    .num_epochs(2)
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    memsave_common::panic_text(&*payload)
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_block_switched_on_without_a_with_cp_method_stops_the_training_and_is_never_silent() {
    watchdog(300, || {
        let device = common::device();
        let model = Trap::new(&device);
        let start = param_bits(&model);

        // With memsave's interrupter: the training stops after the first step, burn-train's
        // result and `finish()` both say why, and no optimizer step was taken.
        let memsave = Memsave::new();
        let learner = memsave.learner(model.clone(), sgd(), LR).unwrap();
        let result = trap_training("trap-interrupter")
            .with_interrupter(memsave.interrupter())
            .launch(learner);
        let said = result
            .error
            .expect("burn-train's result holds the error")
            .to_string();
        assert!(
            said.contains("memsave") && said.contains("`Unmarked`"),
            "{said}"
        );
        assert_eq!(memsave.iterations(), 0, "no optimizer step");
        assert_eq!(param_bits(&result.model.into_model()), start);
        let error = memsave.finish().unwrap_err().to_string();
        assert!(
            error.contains("with_cp") && error.contains("`Unmarked`"),
            "{error}"
        );
        drop(memsave);

        // Without the interrupter: the next optimizer step panics, out of `launch`.
        let memsave = Memsave::new();
        let learner = memsave.learner(model.clone(), sgd(), LR).unwrap();
        let training = trap_training("trap-none");
        let panic = common::catch_quietly(|| training.launch(learner))
            .err()
            .map(panic_text)
            .expect("launch panics");
        assert!(
            panic.contains("memsave stopped the training")
                && panic.contains("`Unmarked`")
                && panic.contains("with_interrupter(memsave.interrupter())"),
            "{panic}"
        );
        drop(memsave);

        // memsave's metrics registered, then an interrupter of the program's own: burn-train's
        // loop goes on, and the next step says why.
        let memsave = Memsave::new();
        let learner = memsave.learner(model.clone(), sgd(), LR).unwrap();
        let training = trap_training("trap-ignored")
            .metrics(memsave.metrics())
            .with_interrupter(burn::train::Interrupter::new());
        let panic = common::catch_quietly(|| training.launch(learner))
            .err()
            .map(panic_text)
            .expect("the next step panics");
        assert!(
            panic.contains("went on after memsave stopped it") && panic.contains("`Unmarked`"),
            "{panic}"
        );
        drop(memsave);

        // With the interrupter, a program that never calls `finish()`: dropping its `Memsave`
        // panics with the error.
        let memsave = Memsave::new();
        let learner = memsave.learner(model, sgd(), LR).unwrap();
        let result = trap_training("trap-unfinished")
            .with_interrupter(memsave.interrupter())
            .launch(learner);
        assert!(result.error.is_some());
        let panic = common::catch_quietly(|| drop(memsave))
            .err()
            .map(panic_text)
            .expect("the last handle dropped panics");
        assert!(
            panic.contains("never taken") && panic.contains("`Unmarked`"),
            "{panic}"
        );
    });
}

#[test]
fn bad_values_and_a_model_already_half_are_errors_naming_them() {
    watchdog(120, || {
        let error = Memsave::new().accumulate(0, 10).unwrap_err().to_string();
        assert!(error.contains("cumulative_iters"), "{error}");
        let error = Memsave::new().accumulate(2, 0).unwrap_err().to_string();
        assert!(error.contains("total_iters"), "{error}");
        let error = Memsave::new().clip_grad_norm(-1.0).unwrap_err().to_string();
        assert!(error.contains("max_norm"), "{error}");
        let half = wrap_fp16_model(net(), Precision::F16);
        let memsave = Memsave::new().fp16(LossScaler::default());
        let error = memsave.model(half).err().expect("an error").to_string();
        assert!(error.contains("already in half precision"), "{error}");
    });
}

/// The Learner's steps run in the run of the thread that made the `Memsave` (memsave-common's
/// `RunContext`): the segments record there, whichever thread burn-train trains on and whatever
/// that thread has installed.
#[test]
fn the_learners_steps_record_into_the_run_memsave_was_made_in() {
    watchdog(300, || {
        let run = memsave_next::RunContext::named("the adapter's run");
        let memsave = run.scope(Memsave::new).unwrap();
        assert_eq!(memsave.context(), run);
        let learner = memsave.learner(net(), sgd(), LR).unwrap();
        // Launched outside the run: the steps enter it.
        let result = SupervisedTraining::new(
            dir("run-context"),
            loader(items(8, 1.0), 4),
            loader(items(4, 1.0), 2),
        )
        .with_interrupter(memsave.interrupter())
        .num_epochs(1)
        .launch(learner);
        assert!(result.error.is_none());
        memsave.finish().unwrap();
        let model = result.model.into_model();
        let block = memsave_next::checkpoint::SegmentId::of(&model.blocks[0]);
        let reached = || memsave_next::checkpoint::reached(block);
        assert!(run.scope(reached).unwrap());
        assert!(!reached(), "recorded in the launching thread's own run");
    });
}
