//! The device suite: memsave's strategies on a GPU runtime, through the same code a user's run
//! takes. It runs on Burn's wgpu backend when built with `--features wgpu` (CI: lavapipe, a
//! software Vulkan device), on CUDA with `--features cuda` (`scripts/device_check.sh`), and on
//! the CPU (Flex) otherwise, so that the suite itself is checked on every build.
//!
//! ```text
//! cargo test --features vulkan --test device -- --nocapture   # Vulkan (lavapipe or a GPU)
//! cargo test --features cuda --test device -- --nocapture     # an NVIDIA GPU
//! ```
//!
//! Every figure is printed (`device suite:` lines); on lavapipe, times mean nothing and none is
//! taken. Tests share one device: they run one at a time (a lock), each under a watchdog.

mod common;
#[path = "device/offload.rs"]
mod offload;

use std::collections::HashMap;
use std::sync::Mutex;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::conv::Conv2dConfig;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::MaxPool2dConfig;
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Distribution};
use common::tiny::TinyNet;
use common::values;
use memsave::checkpoint::set_with_cp;
use memsave::fp16::{Precision, PrecisionExt};
use memsave::hooks::{LrSchedule, LrUpdaterHook, OptimizerHook};
use memsave::memory::{self, CountingAllocator};
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::models::resnet::{ResNet, ResNetConfig};
use memsave::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{Hook, IterLog, OptimizerKind, RunLength, Runner, TrainState};
use memsave::with_cp;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[cfg(feature = "cuda")]
type K = burn::backend::Cuda;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type K = burn::backend::Wgpu;
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
type K = burn::backend::Flex;

type D = Autodiff<K>;

/// The device's name in the suite's lines.
fn device_name() -> &'static str {
    if cfg!(feature = "cuda") {
        "cuda"
    } else if cfg!(feature = "wgpu") {
        "wgpu"
    } else {
        "cpu"
    }
}

/// One test at a time on the device, under a watchdog (a hang in a device queue fails).
fn on_device<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    static DEVICE: Mutex<()> = Mutex::new(());
    let _turn = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    common::watchdog(600, f)
}

struct Materialise;
impl<B: Backend> ModuleMapper<B> for Materialise {}

/// The worst relative difference over every parameter's gradient (same parameters required).
fn worst(a: &HashMap<ParamId, Vec<f32>>, b: &HashMap<ParamId, Vec<f32>>) -> f32 {
    assert!(!b.is_empty(), "no gradients");
    assert_eq!(a.len(), b.len(), "different parameters got gradients");
    b.iter()
        .map(|(id, reference)| common::max_relative_difference(&a[id], reference))
        .fold(0.0, f32::max)
}

/// `x`'s gradient as fp32.
fn grad_of<const N: usize>(
    x: &Tensor<D, N>,
    grads: &<D as AutodiffBackend>::Gradients,
) -> Vec<f32> {
    values(x.grad(grads).expect("the input has a gradient"))
}

// --- Checkpointed gradients ------------------------------------------------------------------

#[memsave::model]
#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    #[with_cp]
    backbone: ResNet<B>,
    fc: Linear<B>,
}

impl<B: memsave::Backend> Classifier<B> {
    fn loss(&self, images: Tensor<B, 4>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let last = self.backbone.forward(images).pop().expect("four maps");
        let logits = self.fc.forward(last.mean_dim(3).mean_dim(2).flatten(1, 3));
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels)
    }
}

impl<B: AutodiffBackend + memsave::Backend> memsave::train::TrainModel<B> for Classifier<B> {
    type Batch = memsave::models::classifier::ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        Classifier::loss(self, batch.images, batch.labels)
    }
}

fn narrow_resnet(depth: usize, base: usize, device: &burn::tensor::Device<D>) -> Classifier<D> {
    Classifier {
        backbone: ResNetConfig {
            depth,
            base_channels: base,
            ..ResNetConfig::default()
        }
        .init::<D>(device)
        .expect("a ResNet"),
        fc: LinearConfig::new(base * 8 * if depth >= 50 { 4 } else { 1 }, 4).init(device),
    }
    .map(&mut Materialise)
}

/// A transformer block as the transformer example's: pre-norm attention-free mixer and MLP with
/// dropout, checkpointed as one segment.
#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    norm1: LayerNorm<B>,
    mix: Linear<B>,
    norm2: LayerNorm<B>,
    up: Linear<B>,
    down: Linear<B>,
    dropout: Dropout,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = x.clone()
            + self
                .dropout
                .forward(self.mix.forward(self.norm1.forward(x)));
        let m = burn::tensor::activation::gelu(self.up.forward(self.norm2.forward(h.clone())));
        h + self.dropout.forward(self.down.forward(m))
    }
}

fn block(width: usize, device: &burn::tensor::Device<D>) -> Block<D> {
    Block {
        norm1: LayerNormConfig::new(width).init(device),
        mix: LinearConfig::new(width, width).init(device),
        norm2: LayerNormConfig::new(width).init(device),
        up: LinearConfig::new(width, 4 * width).init(device),
        down: LinearConfig::new(4 * width, width).init(device),
        dropout: DropoutConfig::new(0.1).init(),
        with_cp: false,
    }
    .map(&mut Materialise)
}

#[test]
fn checkpointed_gradients_equal_plain_ones_with_batch_norm_moved_once_and_dropout_replayed() {
    on_device(|| {
        let device = Default::default();
        D::seed(&device, 11);
        // ResNet-18, narrow: every block checkpointed.
        let model = narrow_resnet(18, 8, &device);
        let images =
            Tensor::<D, 4>::random([2, 3, 32, 32], Distribution::Normal(0.0, 1.0), &device);
        let labels = Tensor::<D, 1, Int>::from_data(TensorData::new(vec![1i64, 2], [2]), &device);
        let checkpointed = set_with_cp(model.clone(), true);
        let plain_grads = model.loss(images.clone(), labels.clone()).backward();
        let cp_grads = checkpointed.loss(images, labels).backward();
        memsave::checkpoint::join_helpers().unwrap();
        let resnet = worst(
            &common::param_grads::<D, _>(&checkpointed, &cp_grads),
            &common::param_grads::<D, _>(&model, &plain_grads),
        );
        // BatchNorm's running statistics moved once per step, as without checkpointing.
        // (memsave's BatchNorm keeps them in `RunningState`s: visited as untracked tensors.)
        let stats = |m: &Classifier<D>| {
            struct Running(Vec<f32>);
            impl ModuleVisitor<D> for Running {
                fn visit_float<const N: usize>(&mut self, param: &Param<Tensor<D, N>>) {
                    let value = param.val();
                    if !value.is_require_grad() {
                        self.0.extend(values(value));
                    }
                }
            }
            let mut running = Running(Vec::new());
            m.visit(&mut running);
            running.0
        };
        let (plain_stats, cp_stats) = (stats(&model), stats(&checkpointed));
        assert!(!plain_stats.is_empty(), "the ResNet has running statistics");
        let moved = common::max_relative_difference(&cp_stats, &plain_stats);

        // The transformer block, with dropout: masks replayed by the recomputation.
        let plain_block = block(32, &device);
        let cp_block = set_with_cp(plain_block.clone(), true);
        let x = Tensor::<D, 3>::random([2, 16, 32], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        D::seed(&device, 5);
        let g_plain = plain_block.forward(x.clone()).sum().backward();
        D::seed(&device, 5);
        let g_cp = cp_block.forward(x.clone()).sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        let transformer = worst(
            &common::param_grads::<D, _>(&cp_block, &g_cp),
            &common::param_grads::<D, _>(&plain_block, &g_plain),
        );
        let dx = common::max_relative_difference(&grad_of(&x, &g_cp), &grad_of(&x, &g_plain));

        // RetinaNet, narrow, every part checkpointed: the backbone's blocks, the neck, the head.
        let detector = retinanet(&device);
        let cp_detector = set_with_cp(detector.clone(), true);
        let batch = detection_batch(&device);
        use memsave::train::TrainModel;
        let g_plain = detector.loss(batch.clone()).backward();
        let g_cp = cp_detector.loss(batch).backward();
        memsave::checkpoint::join_helpers().unwrap();
        let retina = worst(
            &common::param_grads::<D, _>(&cp_detector, &g_cp),
            &common::param_grads::<D, _>(&detector, &g_plain),
        );

        println!(
            "device suite: {}: with_cp vs plain, worst relative gradient difference: ResNet-18 \
             {resnet:e}, transformer block {transformer:e} (input {dx:e}), RetinaNet {retina:e}; \
             BatchNorm running statistics {moved:e}",
            device_name()
        );
        // The recomputation runs the same kernels on the same inputs: bit-identical where the
        // device's kernels are deterministic (Flex, and lavapipe's in our runs), but for the
        // detector's neck and head, whose gradients Burn sums in another order (up to 4e-7 on
        // Flex: models/tests/suite/detection.rs); 1e-5 allows a device whose reductions are not.
        for (what, diff) in [
            ("ResNet-18", resnet),
            ("transformer block", transformer),
            ("transformer input", dx),
            ("RetinaNet", retina),
            ("running statistics", moved),
        ] {
            assert!(diff <= 1e-5, "{what}: {diff:e}");
        }
        assert!(memsave::checkpoint::recomputations() > 0);
    });
}

fn retinanet(
    device: &burn::tensor::Device<D>,
) -> memsave::models::detection::retinanet::RetinaNet<D> {
    use memsave::models::detection::fpn::FpnConfig;
    use memsave::models::detection::retinanet::RetinaNetConfig;
    let mut config = RetinaNetConfig::r50_fpn(4);
    config.backbone = ResNetConfig {
        depth: 18,
        base_channels: 8,
        frozen_stages: 1,
        norm_eval: true,
        ..ResNetConfig::default()
    };
    config.neck = FpnConfig {
        in_channels: vec![8, 16, 32, 64],
        out_channels: 16,
        ..FpnConfig::default()
    };
    config.bbox_head.in_channels = 16;
    config.bbox_head.feat_channels = 16;
    config.bbox_head.stacked_convs = 1;
    config.init::<D>(device).unwrap().map(&mut Materialise)
}

fn detection_batch(
    device: &burn::tensor::Device<D>,
) -> memsave::models::detection::DetectionBatch<D> {
    use memsave::models::detection::ImageMeta;
    let meta = |id: &str, pad: [usize; 2]| ImageMeta {
        id: id.into(),
        ori_shape: pad,
        img_shape: pad,
        pad_shape: pad,
        scale_factor: [1.0, 1.0],
        flip: false,
    };
    memsave::models::detection::DetectionBatch {
        images: Tensor::random([2, 3, 64, 96], Distribution::Normal(0.0, 1.0), device),
        metas: vec![meta("a", [64, 96]), meta("b", [48, 64])],
        gt_bboxes: vec![vec![[10.0, 12.0, 40.0, 50.0]], vec![[4.0, 4.0, 30.0, 20.0]]],
        gt_labels: vec![vec![3], vec![0]],
    }
}

// --- memsave's ops against Burn's ------------------------------------------------------------

#[test]
fn lean_ops_give_burns_outputs_and_gradients_on_the_device() {
    on_device(|| {
        let device = Default::default();
        D::seed(&device, 3);
        assert!(
            memsave::nn::is_lean::<D>(),
            "the device's backend has memsave's lean ops: {:?}",
            memsave::nn::lean_backends()
        );
        let (n, c, s) = (2, 8, 12);
        let x = || Tensor::<D, 4>::random([n, c, s, s], Distribution::Normal(0.5, 1.0), &device);
        let conv = Conv2dConfig::new([c, c], [3, 3])
            .with_padding(PaddingConfig2d::Same)
            .init::<D>(&device)
            .map(&mut Materialise);
        let bn = memsave::nn::BatchNormConfig::new(c).init::<D>(&device);
        let burn_bn = burn::nn::BatchNormConfig::new(c).init::<D>(&device);
        let gn = memsave::nn::GroupNormConfig::new(2, c).init::<D>(&device);
        let burn_gn = burn::nn::GroupNormConfig::new(2, c).init::<D>(&device);
        let ln = LayerNormConfig::new(s).init::<D>(&device);
        let burn_ln = burn::nn::LayerNormConfig::new(s).init::<D>(&device);
        let fc = LinearConfig::new(s, 5)
            .init::<D>(&device)
            .map(&mut Materialise);
        let pool = MaxPool2dConfig::new([3, 3])
            .with_strides([2, 2])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init();
        type Op<'a> = Box<dyn Fn(Tensor<D, 4>) -> Tensor<D, 4> + 'a>;
        let pairs: Vec<(&str, Op, Op)> = vec![
            (
                "batch norm + relu",
                Box::new(|x| bn.forward_relu(x)),
                Box::new(|x| burn::tensor::activation::relu(burn_bn.forward(x))),
            ),
            (
                "batch norm + relu + conv",
                Box::new(|x| bn.forward_relu_conv(x, &conv)),
                Box::new(|x| conv.forward(burn::tensor::activation::relu(burn_bn.forward(x)))),
            ),
            (
                "conv + batch norm",
                Box::new(|x| bn.forward_after_conv(&conv, x)),
                Box::new(|x| burn_bn.forward(conv.forward(x))),
            ),
            (
                "batch norm + relu + max pool",
                Box::new(|x| bn.forward_relu_max_pool(x, &pool)),
                Box::new(|x| pool.forward(burn::tensor::activation::relu(burn_bn.forward(x)))),
            ),
            (
                "group norm",
                Box::new(|x| gn.forward(x)),
                Box::new(|x| burn_gn.forward(x)),
            ),
            (
                "layer norm",
                Box::new(|x| ln.forward(x)),
                Box::new(|x| burn_ln.forward(x)),
            ),
            (
                "relu",
                Box::new(memsave::nn::relu),
                Box::new(burn::tensor::activation::relu),
            ),
            (
                "conv",
                Box::new(|x| memsave::nn::conv2d(&conv, x)),
                Box::new(|x| conv.forward(x)),
            ),
            (
                "linear",
                Box::new(|x| memsave::nn::linear(&fc, x)),
                Box::new(|x| fc.forward(x)),
            ),
            (
                "max pool",
                Box::new(|x| memsave::nn::max_pool2d(&pool, x)),
                Box::new(|x| pool.forward(x)),
            ),
        ];
        let mut lines = Vec::new();
        for (name, ours, burns) in &pairs {
            let input = x();
            let weights = Tensor::<D, 4>::random(
                ours(input.clone()).dims(),
                Distribution::Normal(0.0, 1.0),
                &device,
            );
            let run = |op: &Op| {
                let x = input.clone().detach().require_grad();
                let y = op(x.clone());
                let grads = (y.clone() * weights.clone()).sum().backward();
                memsave::checkpoint::join_helpers().unwrap();
                let dx = grad_of(&x, &grads);
                let params: Vec<f32> = [
                    common::param_grads::<D, _>(&conv, &grads),
                    common::param_grads::<D, _>(&fc, &grads),
                ]
                .into_iter()
                .flat_map(|g| {
                    let mut g: Vec<_> = g.into_iter().collect();
                    g.sort_by_key(|(id, _)| id.to_string());
                    g.into_iter().flat_map(|(_, v)| v)
                })
                .collect();
                (values(y), dx, params)
            };
            let (y1, dx1, p1) = run(ours);
            let (y2, dx2, p2) = run(burns);
            let forward = common::max_relative_difference(&y1, &y2);
            let input_grad = common::max_relative_difference(&dx1, &dx2);
            let param_grad = if p2.is_empty() {
                0.0
            } else {
                common::max_relative_difference(&p1, &p2)
            };
            lines.push(format!(
                "{name} {forward:.1e}/{input_grad:.1e}/{param_grad:.1e}"
            ));
            for (what, diff) in [
                ("output", forward),
                ("input gradient", input_grad),
                ("weight gradient", param_grad),
            ] {
                assert!(diff <= 1e-4, "{name}: {what} differs by {diff:e}");
            }
        }
        println!(
            "device suite: {}: memsave's ops vs Burn's, relative difference output/input \
             gradient/weight gradient: {}",
            device_name(),
            lines.join(", ")
        );
    });
}

// --- Mixed precision -------------------------------------------------------------------------

/// Each iteration's log, and the dtypes of the weights the forward ran on and of the masters.
struct Recorder(std::sync::Arc<Mutex<Vec<(IterLog, DType, DType)>>>);

impl Hook<D, TinyNet<D>> for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn after_iter(&mut self, state: &mut TrainState<D, TinyNet<D>>) -> memsave::Result<()> {
        let forward = state.forward_model().fc.weight.val().dtype();
        let master = state.model.fc.weight.val().dtype();
        self.0
            .lock()
            .unwrap()
            .push((state.log.clone(), forward, master));
        Ok(())
    }
}

/// Losses, steps taken and the weights' dtype of a short run at `precision` (None: fp32).
fn short_run(
    precision: Option<Precision>,
    init_scale: f64,
) -> (Vec<(IterLog, DType, DType)>, Vec<f32>) {
    let device: burn::tensor::Device<D> = Default::default();
    let model = TinyNet::<D>::new(4, false, &device).map(&mut common::tiny::Seeded(7));
    let mut config = SyntheticClassificationConfig::new(8, 64, 8);
    config.seed = 3;
    let data = SyntheticClassification::<D>::new(config, 4, device).unwrap();
    let hook = match precision {
        None => OptimizerHook::new(),
        Some(precision) => OptimizerHook::new().with_mixed_precision(
            LossScaler::new(init_scale, ScaleMode::Dynamic, 2.0, 2000).unwrap(),
            precision,
        ),
    };
    let dir = std::env::temp_dir().join(format!(
        "memsave-device-{}-{precision:?}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let mut runner: Runner<D, TinyNet<D>, SyntheticClassification<D>> = Runner::new(
        model,
        &OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        },
        Box::new(hook),
        data,
        RunLength::Iters(24),
        &dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.2),
    }));
    let log = std::sync::Arc::new(Mutex::new(Vec::new()));
    runner.register_hook(Box::new(Recorder(log.clone())));
    runner.run().unwrap();
    let weights = runner
        .state()
        .model
        .fc
        .weight
        .val()
        .cast(DType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let log = log.lock().unwrap().clone();
    (log, weights)
}

#[test]
fn half_precision_training_with_dynamic_loss_scaling_skips_an_overflow_and_learns() {
    on_device(|| {
        let device: burn::tensor::Device<D> = Default::default();
        let (fp32, _) = short_run(None, 1.0);
        let mean = |log: &[(IterLog, DType, DType)], range: std::ops::Range<usize>| {
            let n = range.len() as f64;
            log[range]
                .iter()
                .map(|(l, _, _)| l.loss.unwrap())
                .sum::<f64>()
                / n
        };
        let fp32_tail = mean(&fp32, 16..24);
        let mut lines = vec![format!(
            "fp32 loss {:.4} -> {fp32_tail:.4}",
            mean(&fp32, 0..4)
        )];
        for precision in [Precision::F16, Precision::Bf16] {
            if !K::supports_dtype(&device, precision.dtype()) {
                lines.push(format!("{precision:?}: not supported by this device"));
                continue;
            }
            // 2^20 overflows f16 on the first steps (as MMCV's 2^32 does): skipped, halved,
            // then training proceeds.
            let (log, weights) = short_run(Some(precision), (1u64 << 20) as f64);
            let skipped = log.iter().take_while(|(l, _, _)| !l.stepped).count();
            let tail = mean(&log, 16..24);
            lines.push(format!(
                "{precision:?}: {skipped} steps skipped at the start (scale {} -> {}), loss \
                 {tail:.4} at steps 17-24, forward weights {:?}, masters {:?}",
                log[0].0.loss_scale.unwrap(),
                log.last().unwrap().0.loss_scale.unwrap(),
                log[0].1,
                log[0].2
            ));
            assert_eq!(
                log[0].1,
                precision.dtype(),
                "the forward runs on half weights"
            );
            assert_eq!(log[0].2, DType::F32, "the masters stay fp32");
            assert!(weights.iter().all(|w| w.is_finite()));
            if precision == Precision::F16 {
                assert!(skipped >= 1, "2^20 overflows f16: {skipped} skipped");
                assert!(
                    log[skipped].0.loss_scale.unwrap() < (1u64 << 20) as f64,
                    "the scale backed off"
                );
            }
            assert!(
                log.iter().any(|(l, _, _)| l.stepped),
                "{precision:?} never stepped"
            );
            assert!(
                (tail - fp32_tail).abs() <= 0.1 * fp32_tail.max(0.1),
                "{precision:?} loss {tail} vs fp32 {fp32_tail}"
            );
        }
        println!("device suite: {}: {}", device_name(), lines.join("; "));
    });
}

// --- The pool meter --------------------------------------------------------------------------

#[test]
fn the_device_meter_sees_checkpointing_lower_the_peak_and_accumulation_keep_one_gradient_set() {
    on_device(|| {
        let device: burn::tensor::Device<D> = Default::default();
        D::seed(&device, 1);
        let meter = memory::meter_for(&device).expect("the device's memory can be read");
        let model = narrow_resnet(18, 8, &device);
        let images =
            Tensor::<D, 4>::random([4, 3, 160, 160], Distribution::Normal(0.0, 1.0), &device);
        let labels =
            Tensor::<D, 1, Int>::from_data(TensorData::new(vec![0i64, 1, 2, 3], [4]), &device);
        let peak = |model: &Classifier<D>| {
            let mut peak = 0;
            let mut kept = 0;
            for _ in 0..2 {
                let base = meter.reset_peak();
                let loss = model.loss(images.clone(), labels.clone());
                kept = meter.live() - base;
                let grads = loss.backward();
                memsave::checkpoint::join_helpers().unwrap();
                peak = meter.peak() - base;
                drop(grads);
            }
            (kept, peak)
        };
        let (plain_kept, plain) = peak(&model);
        let (cp_kept, checkpointed) = peak(&set_with_cp(model.clone(), true));

        // Accumulation: the sums seed the backward pass; its peak is one gradient set's.
        // Read while the gradients are held: what a step keeps, one set or two.
        let fc: Linear<D> = LinearConfig::new(1024, 1024)
            .init(&device)
            .map(&mut Materialise);
        let input = Tensor::<D, 2>::random([4, 1024], Distribution::Normal(0.0, 1.0), &device);
        let step = |sums| {
            memsave::train::grads::backward(fc.forward(input.clone()).sum(), &fc, sums).unwrap()
        };
        let start = meter.live();
        let sums = step(None);
        let alone = meter.live() - start;
        // The second micro-batch's backward adds onto the sums: one set held, not two.
        let summed = step(Some(sums));
        let seeded = meter.live() - start;
        drop(summed);
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        println!(
            "device suite: {}: step peak above its start (pool high-water mark), ResNet-18 \
             width 8, 4 x 160 x 160: plain {:.2} MiB, every block checkpointed {:.2} MiB \
             ({:.2}x); a linear 1024x1024's gradients held {:.2} MiB alone, {:.2} MiB onto the sums \
             (reserved now {:?} B)",
            device_name(),
            mib(plain),
            mib(checkpointed),
            checkpointed as f64 / plain as f64,
            mib(alone),
            mib(seeded),
            meter.reserved(),
        );
        assert!(plain > 0, "the meter read the step");
        println!(
            "device suite: {}: kept for backward after the forward: plain {:.2} MiB, \
             checkpointed {:.2} MiB",
            device_name(),
            mib(plain_kept),
            mib(cp_kept)
        );
        assert!(
            cp_kept < plain_kept,
            "checkpointing keeps less for backward: {cp_kept} vs {plain_kept}"
        );
        assert!(
            checkpointed < plain + plain / 2,
            "the checkpointed peak stays near the plain one: {checkpointed} vs {plain}"
        );
        let weights = 1024 * 1024 * 4;
        assert!(
            seeded <= alone + weights / 4,
            "no second gradient set: {seeded} vs {alone}"
        );
    });
}

// --- Recomputation on helper threads ---------------------------------------------------------

#[memsave::model]
#[derive(Module, Debug)]
struct Deep<B: Backend> {
    #[with_cp]
    layers: Vec<Segment<B>>,
}

#[memsave::model]
#[derive(Module, Debug)]
struct Segment<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Segment<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        x.clone()
            + self
                .b
                .forward(burn::tensor::activation::relu(self.a.forward(x)))
    }
}

#[test]
fn recomputed_tensors_are_written_before_they_are_read_on_the_consuming_stream() {
    on_device(|| {
        let device: burn::tensor::Device<D> = Default::default();
        D::seed(&device, 2);
        let width = 256;
        let plain = Deep {
            layers: (0..12)
                .map(|_| Segment {
                    a: LinearConfig::new(width, width).init(&device),
                    b: LinearConfig::new(width, width).init(&device),
                    with_cp: false,
                })
                .collect(),
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = Tensor::<D, 2>::random([128, width], Distribution::Normal(0.0, 1.0), &device);
        let run = |model: &Deep<D>| {
            let y = model.layers.iter().fold(x.clone(), |h, l| l.forward(h));
            let grads = y.square().mean().backward();
            memsave::checkpoint::join_helpers().unwrap();
            common::param_grads::<D, _>(model, &grads)
        };
        let reference = run(&plain);
        let mut worst_seen = 0.0f32;
        for _ in 0..50 {
            worst_seen = worst_seen.max(worst(&run(&checkpointed), &reference));
        }
        println!(
            "device suite: {}: 12 checkpointed segments of 256-wide layers, 50 repetitions: \
             worst relative gradient difference {worst_seen:e}",
            device_name()
        );
        assert!(worst_seen <= 1e-5, "{worst_seen:e}");
    });
}

// --- The command line on the device ----------------------------------------------------------

fn memsave_cmd() -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_memsave"));
    command.env("XDG_RUNTIME_DIR", std::env::temp_dir());
    command
}

/// `--device wgpu` (or `cuda`) where the runtime finds no adapter or driver: an error naming
/// the flag, the device and what to install, exit 1, nothing written. On wgpu the Vulkan
/// loader is pointed at no driver (`VK_ICD_FILENAMES`, `VK_DRIVER_FILES`); on CUDA the driver
/// library is hidden (`LD_LIBRARY_PATH` cannot hide a system one, so CUDA is not run).
#[test]
fn a_device_without_a_driver_is_the_flags_error_with_what_to_install() {
    if device_name() != "wgpu" {
        return;
    }
    on_device(|| {
        let dir = std::env::temp_dir().join(format!("memsave-no-driver-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/resnet18_synthetic.toml"
        );
        let out = memsave_cmd()
            .env("VK_ICD_FILENAMES", "/nonexistent/memsave-no-driver.json")
            .env("VK_DRIVER_FILES", "/nonexistent/memsave-no-driver.json")
            .args(["train", config, "--device", "wgpu", "--work-dir"])
            .arg(&dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("device suite: wgpu without a driver: {}", stderr.trim());
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        for expected in ["--device", "wgpu", "mesa-vulkan-drivers", "driver"] {
            assert!(stderr.contains(expected), "no `{expected}` in: {stderr}");
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!dir.exists(), "{} was written", dir.display());
    });
}

#[test]
fn train_and_bench_run_on_the_device_and_end_cleanly() {
    on_device(|| {
        let dir = std::env::temp_dir().join(format!("memsave-device-cli-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/resnet18_synthetic.toml"
        );
        let out = memsave_cmd()
            .args(["train", config, "--device", device_name(), "--work-dir"])
            .arg(&dir)
            .args([
                "--set",
                "runner.max_epochs=1",
                "--set",
                "data.num_samples=16",
                "--set",
                "data.samples_per_gpu=4",
                "--set",
                "model.backbone.with_cp=true",
                "--set",
                "offload.activations=true",
                // Narrow: lavapipe runs the full-width ResNet-18 at about 15 s an iteration.
                "--set",
                "model.backbone.base_channels=16",
            ])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "train on {}: {text}", device_name());
        assert!(text.contains("loss"), "{text}");
        // Activation offload: on a device, on without a word; on the CPU, said off once.
        let said_off = text.matches("nothing to offload to").count();
        if offload::ON_A_DEVICE {
            assert_eq!(said_off, 0, "{text}");
        } else {
            assert_eq!(said_off, 1, "{text}");
        }
        assert!(!text.contains("offloaded nothing"), "{text}");
        let out = memsave_cmd()
            .args([
                "bench",
                "--device",
                device_name(),
                "--iters",
                "1",
                "--warmup",
                "1",
            ])
            .args([
                // The narrow synthetic-VOC RetinaNet (FPN and head of 64 channels): the built-in
                // R50 config at depth 18 keeps 256-channel FPN and head, 48 s a step on lavapipe.
                "--config",
                concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/configs/retinanet_r18_fpn_synthvoc.toml"
                ),
                "--image-size",
                "64",
                "--only",
                "base,checkpoint,offload_activations,offload_optimizer",
                "--out",
            ])
            .arg(dir.join("bench"))
            .output()
            .unwrap();
        let bench = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "bench on {}: {bench}", device_name());
        // CPU staging's rows: the host's peak beside the device's on a device; on the CPU none
        // (one memory), and each offload said off.
        let report: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("bench").join("bench.json")).unwrap(),
        )
        .unwrap();
        let configs = report["configs"].as_array().unwrap();
        assert_eq!(configs.len(), 4, "{bench}");
        for config in configs {
            let host = config.get("host_peak_bytes").and_then(|v| v.as_u64());
            if offload::ON_A_DEVICE {
                assert!(host.is_some(), "{config}");
            } else {
                assert!(host.is_none(), "{config}");
            }
        }
        println!(
            "device suite: {}: `memsave train` (1 epoch, 4 iterations, checkpointed, activation \
             offload asked for) and \
             `memsave bench` (the narrow R18-FPN, 64 x 64, base, checkpoint and both offloads) ended \
             cleanly",
            device_name()
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

// --- The optimizer's step in backward and 8-bit state on the device --------------------------

/// A run of `iters` iterations of the tiny classifier with `hook`, `optimizer`: its final
/// weights (fp32) and losses.
fn tiny_run(
    hook: OptimizerHook,
    optimizer: memsave::train::OptimizerSpec,
    iters: usize,
    start: &TinyNet<D>,
) -> (Vec<f32>, Vec<f64>) {
    let device: burn::tensor::Device<D> = Default::default();
    let mut config = SyntheticClassificationConfig::new(8, 64, 8);
    config.seed = 3;
    let data = SyntheticClassification::<D>::new(config, 4, device).unwrap();
    let dir = std::env::temp_dir().join(format!(
        "memsave-device-sib-{}-{}",
        std::process::id(),
        hook.step_in_backward
    ));
    let mut runner: Runner<D, TinyNet<D>, SyntheticClassification<D>> = Runner::new(
        start.clone(),
        optimizer,
        Box::new(hook),
        data,
        RunLength::Iters(iters),
        &dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.05),
    }));
    let log = std::sync::Arc::new(Mutex::new(Vec::new()));
    runner.register_hook(Box::new(Recorder(log.clone())));
    runner.run().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let weights = values(runner.state().model.fc.weight.val().inner());
    let losses = log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(log, _, _)| log.loss)
        .collect();
    (weights, losses)
}

#[test]
fn the_step_in_backward_and_8_bit_state_run_on_the_device() {
    on_device(|| {
        let device: burn::tensor::Device<D> = Default::default();
        let start = TinyNet::<D>::new(4, false, &device).map(&mut common::tiny::Seeded(7));
        let sgd = OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 1e-4,
            nesterov: false,
        };
        // Clipping: two passes, the second forward replaying the first.
        let clipped = || {
            OptimizerHook::new()
                .with_grad_clip(Some(memsave::hooks::GradClip::new(0.5, 2.0).unwrap()))
        };
        let (ordinary, losses) = tiny_run(clipped(), sgd.clone().into(), 6, &start);
        let (in_backward, losses_ib) = tiny_run(
            clipped().with_step_in_backward(true),
            sgd.clone().into(),
            6,
            &start,
        );
        let worst = common::max_relative_difference(&in_backward, &ordinary);
        println!(
            "device suite: {}: step in backward (clipped: two passes) vs the ordinary step, 6 \
             iterations: worst relative weight difference {worst:e}",
            device_name()
        );
        assert_eq!(losses.len(), losses_ib.len());
        assert!(worst <= 1e-6, "{worst:e}");

        // 8-bit state on the device's own ops (CubeCL: the tensor-op quantization).
        let adam = OptimizerKind::AdamW {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let wide = |state| {
            let mlp = common::mlp::Mlp::<D>::new(3 * 8 * 8, 128, 2, 0.0, &device)
                .map(&mut common::tiny::Seeded(5));
            let hook = OptimizerHook::new();
            let mut runner = mlp_runner(mlp, adam.clone().with_state_dtype(state), hook, 3);
            runner.run().unwrap();
            runner.state().optimizer.to_bytes().unwrap().len()
        };
        let (full, eight) = (
            wide(memsave::train::StateDtype::F32),
            wide(memsave::train::StateDtype::Int8),
        );
        println!(
            "device suite: {}: AdamW's state written: {full} B in fp32, {eight} B in 8 bits \
             ({:.2}x)",
            device_name(),
            eight as f64 / full as f64
        );
        assert!(eight * 10 < full * 3, "{eight} vs {full}");

        // The device's high-water mark, six 512-wide layers: the step in backward holds no
        // whole gradient set.
        let meter = memory::meter_for(&device).expect("the device's memory can be read");
        let mlp = common::mlp::Mlp::<D>::new(3 * 8 * 8, 512, 6, 0.0, &device)
            .map(&mut common::tiny::Seeded(5));
        let gradients = memsave::train::params::param_bytes::<D, _>(&mlp).1;
        let peak = |in_backward: bool| {
            let hook = OptimizerHook::new().with_step_in_backward(in_backward);
            let mut runner = mlp_runner(mlp.clone(), sgd.clone().into(), hook, 4);
            run_measured(&mut runner, 2, 4)
        };
        let (ordinary, in_backward) = (peak(false), peak(true));
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        println!(
            "device suite: {}: step peak (pool high-water mark), six 512-wide layers: ordinary \
             {:.2} MiB, step in backward {:.2} MiB; gradients {:.2} MiB (live now {:.2} MiB)",
            device_name(),
            mib(ordinary),
            mib(in_backward),
            mib(gradients),
            mib(meter.live())
        );
        assert!(
            in_backward + gradients / 4 < ordinary,
            "{in_backward} vs {ordinary} ({gradients} bytes of gradients)"
        );
    });
}

/// Runs `runner`; the most the device held in any of iterations `from..to` (whole step).
fn run_measured(
    runner: &mut Runner<D, common::mlp::Mlp<D>, SyntheticClassification<D>>,
    from: usize,
    to: usize,
) -> u64 {
    let device: burn::tensor::Device<D> = Default::default();
    let meter = memory::meter_for(&device).expect("the device's memory can be read");
    let steps = memsave::planner::StepMeter::new(from, to, meter);
    let measured = steps.steps.clone();
    runner.register_hook(Box::new(steps));
    runner.run().unwrap();
    let peak = measured.borrow().iter().map(|(_, peak)| *peak).max();
    peak.expect("a step was measured")
}

/// A run of `iters` iterations of `mlp` on synthetic 8 x 8 images, lr 0.001.
fn mlp_runner(
    mlp: common::mlp::Mlp<D>,
    optimizer: memsave::train::OptimizerSpec,
    hook: OptimizerHook,
    iters: usize,
) -> Runner<D, common::mlp::Mlp<D>, SyntheticClassification<D>> {
    let device: burn::tensor::Device<D> = Default::default();
    let data =
        SyntheticClassification::<D>::new(SyntheticClassificationConfig::new(4, 64, 8), 4, device)
            .unwrap();
    let dir = std::env::temp_dir().join(format!("memsave-device-mlp-{}", std::process::id()));
    let mut runner = Runner::new(
        mlp,
        optimizer,
        Box::new(hook),
        data,
        RunLength::Iters(iters),
        dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.001),
    }));
    runner
}

/// Asks the device for more than it has at one iteration, as a model too large for it would.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
struct Exhaust {
    at: usize,
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl Hook<D, TinyNet<D>> for Exhaust {
    fn name(&self) -> &'static str {
        "exhaust"
    }

    fn after_iter(&mut self, state: &mut TrainState<D, TinyNet<D>>) -> memsave::Result<()> {
        if state.iter == self.at {
            // 1 TiB of fp32: no device has it.
            let huge = Tensor::<K, 1>::zeros([1usize << 38], &state.device);
            drop(huge.into_data());
        }
        Ok(())
    }
}

/// A step past the device's memory, in a process of its own: a CubeCL runtime whose server
/// thread cannot allocate (wgpu's) is unusable afterwards, which the other tests must not see.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn a_device_out_of_memory_ends_the_run_with_advice_and_keeps_the_checkpoints() {
    on_device(|| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "out_of_memory_in_a_process_of_its_own",
                "--exact",
                "--include-ignored",
                "--nocapture",
            ])
            .env("MEMSAVE_DEVICE_OOM_CHILD", "1")
            .env("XDG_RUNTIME_DIR", std::env::temp_dir())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        let line = text
            .lines()
            .find(|line| line.starts_with("device suite:"))
            .unwrap_or_else(|| panic!("the child said nothing: {text}"));
        println!("{line}");
    });
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
#[ignore = "run by a_device_out_of_memory_ends_the_run_with_advice_and_keeps_the_checkpoints"]
fn out_of_memory_in_a_process_of_its_own() {
    if std::env::var_os("MEMSAVE_DEVICE_OOM_CHILD").is_none() {
        return;
    }
    let device: burn::tensor::Device<D> = Default::default();
    let dir = std::env::temp_dir().join(format!("memsave-device-oom-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut config = SyntheticClassificationConfig::new(4, 32, 8);
    config.seed = 3;
    let mut runner = Runner::new(
        TinyNet::<D>::new(4, false, &device).map(&mut common::tiny::Seeded(7)),
        &OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        },
        Box::new(OptimizerHook::new()),
        SyntheticClassification::<D>::new(config, 4, device).unwrap(),
        RunLength::Iters(4),
        &dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.05),
    }));
    runner.register_hook(Box::new(memsave::hooks::SnapshotHook::new(1, false)));
    runner.register_hook(Box::new(Exhaust { at: 2 }));
    let error = runner.run().unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, memsave::Error::OutOfMemory { .. }),
        "{message}"
    );
    assert!(message.contains("iteration 2"), "{message}");
    assert!(message.contains("checkpointing"), "advice: {message}");
    // The snapshots written before it are whole.
    let saved = memsave::train::Snapshot::load(&dir.join("iter_2.ckpt")).unwrap();
    assert_eq!(saved.meta.iter, 2);
    println!(
        "device suite: {}: a step past the device's memory ends the run with an error and \
         advice, the snapshot before it whole: {}",
        device_name(),
        message.lines().next().unwrap_or_default()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
