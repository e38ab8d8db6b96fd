//! Your own model in memsave's runner: a small U-Net that denoises synthetic images (not a
//! ResNet, not a classifier), its `TrainModel` and `DataSource`, the learning rate, mixed
//! precision, accumulation and checkpointing, each one line; and, before training, the one-call
//! check that checkpointing (and half precision) changes nothing but memory.
//!
//! ```text
//! cargo run --release --example own_model                                  # fp32, every step
//! cargo run --release --example own_model -- --fp16 --accumulate 2 --with-cp
//! ```
//!
//! Switches: `--fp16` (f16 with a dynamic loss scale from PyTorch's 65536), `--accumulate K`
//! (K micro-batches per step, the loss divided by K: MMCV's `GradientCumulativeOptimizerHook`),
//! `--with-cp` (every `#[with_cp]` block recomputed in backward), `--iters N` (default 60).

use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::PaddingConfig2d;
use burn::prelude::*;
use burn::tensor::module::{avg_pool2d, interpolate};
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
use burn::tensor::{Distribution, TensorData};
use memsave::check::ModelCheck;
use memsave::checkpoint::set_with_cp;
use memsave::fp16::{Fp16, Precision};
use memsave::hooks::{Groups, LrSchedule, LrUpdaterHook, OptimizerHook, Policy, Warmup};
use memsave::memory::CountingAllocator;
use memsave::nn::{BatchNorm, BatchNormConfig};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{DataSource, Hook, OptimizerKind, RunLength, Runner, TrainModel, TrainState};
use memsave::{auto_fp16, force_fp32, with_cp};

type B = Autodiff<Flex>;

/// Counts the heap, so that the check can say what checkpointing saved.
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// conv-BN-ReLU twice. `#[memsave::model]` lets `wrap_fp16_model` and `set_with_cp` reach it;
/// its `with_cp` flag is what `#[with_cp]` reads.
#[memsave::model]
#[derive(Module, Debug)]
pub struct DoubleConv<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> DoubleConv<B> {
    pub fn new(channels: [usize; 2], device: &B::Device) -> Self {
        let conv = |c: [usize; 2]| {
            Conv2dConfig::new(c, [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .with_bias(false)
                .init(device)
        };
        DoubleConv {
            conv1: conv(channels),
            bn1: BatchNormConfig::new(channels[1]).init(device),
            conv2: conv([channels[1], channels[1]]),
            bn2: BatchNormConfig::new(channels[1]).init(device),
            with_cp: false,
        }
    }

    /// Recomputed in backward when `with_cp` is on: only its input is kept.
    #[with_cp]
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = burn::tensor::activation::relu(self.bn1.forward(self.conv1.forward(x)));
        burn::tensor::activation::relu(self.bn2.forward(self.conv2.forward(x)))
    }
}

/// A two-level U-Net: predicts the clean image from a noisy one.
#[memsave::model]
#[derive(Module, Debug)]
pub struct UNet<B: Backend> {
    /// Gets the network's input: never checkpointed (MMCV's guard), so not marked.
    inc: DoubleConv<B>,
    #[with_cp]
    down: DoubleConv<B>,
    #[with_cp]
    bottom: DoubleConv<B>,
    #[with_cp]
    up: DoubleConv<B>,
    out: Conv2d<B>,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> UNet<B> {
    pub fn new(width: usize, device: &B::Device) -> Self {
        UNet {
            inc: DoubleConv::new([1, width], device),
            down: DoubleConv::new([width, 2 * width], device),
            bottom: DoubleConv::new([2 * width, 2 * width], device),
            up: DoubleConv::new([3 * width, width], device),
            out: Conv2dConfig::new([width, 1], [1, 1]).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    /// `[N, 1, H, W]` -> `[N, 1, H, W]` (H and W even). fp32 in; half inside under `--fp16`.
    #[auto_fp16(apply_to = (noisy))]
    pub fn forward(&self, noisy: Tensor<B, 4>) -> Tensor<B, 4> {
        let skip = self.inc.forward(noisy);
        let [_, _, h, w] = skip.dims();
        let low = self.down.forward(avg_pool2d(
            skip.clone(),
            [2, 2],
            [2, 2],
            [0, 0],
            true,
            false,
        ));
        let low = self.bottom.forward(low);
        let options = InterpolateOptions::new(InterpolateMode::Nearest);
        let up = interpolate(low, [h, w], options);
        self.out
            .forward(self.up.forward(Tensor::cat(vec![up, skip], 1)))
    }

    /// Mean squared error, in fp32 whatever the prediction's precision.
    #[force_fp32(args = (predicted))]
    pub fn loss(&self, predicted: Tensor<B, 4>, clean: Tensor<B, 4>) -> Tensor<B, 1> {
        (predicted - clean).powi_scalar(2).mean()
    }
}

/// A batch: noisy images and the clean ones.
#[derive(Clone, Debug)]
pub struct Pair<B: Backend> {
    noisy: Tensor<B, 4>,
    clean: Tensor<B, 4>,
}

impl TrainModel<B> for UNet<B> {
    type Batch = Pair<B>;

    fn loss(&self, batch: Pair<B>) -> Tensor<B, 1> {
        UNet::loss(self, self.forward(batch.noisy), batch.clean)
    }
}

/// Synthetic images: a bright rectangle on a dark field, with Gaussian noise. The same batch for
/// the same `(epoch, index)`, as the runner's exact resume needs; made on the device the runner
/// passes.
pub struct Rectangles {
    batch: usize,
    batches: usize,
    size: usize,
}

impl Rectangles {
    fn pair<D: Backend>(&self, epoch: usize, index: usize, device: &D::Device) -> Pair<D> {
        let n = self.size;
        let mut clean = Vec::with_capacity(self.batch * n * n);
        for sample in 0..self.batch {
            // A cheap hash of (epoch, index, sample) places the rectangle.
            let h = (epoch * 7919 + index * 104_729 + sample * 1_299_709) as u64;
            let h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16;
            let (x0, y0) = (
                (h % (n as u64 / 2)) as usize,
                ((h >> 8) % (n as u64 / 2)) as usize,
            );
            let (w, hgt) = (4 + ((h >> 16) % 8) as usize, 4 + ((h >> 24) % 8) as usize);
            for y in 0..n {
                for x in 0..n {
                    let inside = (x0..x0 + w).contains(&x) && (y0..y0 + hgt).contains(&y);
                    clean.push(if inside { 1.0f32 } else { 0.0 });
                }
            }
        }
        let shape = [self.batch, 1, n, n];
        let clean = Tensor::<D, 4>::from_data(TensorData::new(clean, shape), device);
        D::seed(device, (epoch * 1000 + index) as u64);
        let noise = Tensor::random(shape, Distribution::Normal(0.0, 0.3), device);
        Pair {
            noisy: clean.clone() + noise,
            clean,
        }
    }
}

impl DataSource<B, Pair<B>> for Rectangles {
    fn batches_per_epoch(&self) -> usize {
        self.batches
    }

    fn batch(
        &self,
        epoch: usize,
        index: usize,
        device: &burn::tensor::Device<B>,
    ) -> memsave::Result<Pair<B>> {
        Ok(self.pair::<B>(epoch, index, device))
    }
}

/// Keeps each iteration's loss and whether the optimizer stepped.
struct Losses(Arc<Mutex<Vec<(f64, bool)>>>);

impl Hook<B, UNet<B>> for Losses {
    fn name(&self) -> &'static str {
        "losses"
    }

    fn after_iter(&mut self, state: &mut TrainState<B, UNet<B>>) -> memsave::Result<()> {
        let loss = state.log.loss.unwrap_or(f64::NAN);
        self.0.lock().unwrap().push((loss, state.log.stepped));
        Ok(())
    }
}

struct Args {
    fp16: bool,
    accumulate: usize,
    with_cp: bool,
    iters: usize,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        fp16: false,
        accumulate: 1,
        with_cp: false,
        iters: 60,
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
            "--iters" => args.iters = number("--iters")?,
            other => {
                return Err(format!(
                    "unknown argument `{other}`: use --fp16, --accumulate K, --with-cp, --iters N"
                ))
            }
        }
    }
    Ok(args)
}

fn main() {
    let args = match args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("own_model: {message}");
            std::process::exit(2);
        }
    };
    if let Err(error) = run(args) {
        eprintln!("own_model: {error}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> memsave::Result<()> {
    let device = Default::default();
    B::seed(&device, 0);
    let data = Rectangles {
        batch: 8 / args.accumulate.min(8),
        batches: 16,
        size: 32,
    };
    let model = UNet::<B>::new(16, &device);

    // 1. The check: with and without checkpointing (and f16), one batch, gradients compared.
    //    It materialises Burn's lazy weights and reseeds before each pass by itself.
    let probe = data.pair::<B>(0, 0, &device);
    let report = ModelCheck::default()
        .with_precision(Precision::F16)
        .run_with_fp16(model.clone(), |m: &UNet<B>| {
            TrainModel::loss(m, probe.clone())
        })?;
    println!("{report}");

    // 2. Training. Each strategy is one line.
    let mut model = model;
    if args.with_cp {
        model = set_with_cp(model, true); // MMCV's with_cp=True
    }
    let mut hook = OptimizerHook::new().with_groups(Groups::new(args.accumulate)?);
    if args.fp16 {
        // The hook keeps the weights in fp32 (the masters) and wraps its forward copy itself:
        // the model is given to the runner unwrapped.
        let scaler = LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 1000)?;
        hook = hook.with_mixed_precision(scaler, Precision::F16);
    }
    let work_dir = std::env::temp_dir().join(format!("memsave-own-model-{}", std::process::id()));
    let mut runner = Runner::new(
        model,
        OptimizerKind::adamw().with_weight_decay(1e-4),
        Box::new(hook),
        data,
        RunLength::Iters(args.iters * args.accumulate),
        &work_dir,
        device,
    )?;
    // The learning rate: a constant would be `runner.set_lr(2e-3)?`; here MMCV's linear
    // warm-up, then a step down by 10x at two thirds of the run. Without either the runner
    // stops with an error naming `lr`.
    let iters = args.iters * args.accumulate;
    runner.register_hook(Box::new(LrUpdaterHook::new(LrSchedule {
        base_lr: 2e-3,
        policy: Policy::Step,
        step: vec![iters * 2 / 3],
        by_epoch: Some(false),
        warmup: Some(Warmup::Linear),
        warmup_iters: 5 * args.accumulate,
        warmup_ratio: 0.1,
        ..LrSchedule::default()
    })?));
    let losses = Arc::new(Mutex::new(Vec::new()));
    runner.register_hook(Box::new(Losses(losses.clone())));
    runner.run()?;
    let _ = std::fs::remove_dir_all(&work_dir);

    let losses = losses.lock().unwrap();
    let steps = losses.iter().filter(|(_, stepped)| *stepped).count();
    let mean = |part: &[(f64, bool)]| part.iter().map(|(l, _)| l).sum::<f64>() / part.len() as f64;
    let tenth = (losses.len() / 10).max(1);
    println!(
        "trained {} iterations ({steps} optimizer steps; fp16 {}, accumulate {}, with_cp {}): \
         mean loss over the first {tenth} {:.4}, over the last {tenth} {:.4}",
        losses.len(),
        args.fp16,
        args.accumulate,
        args.with_cp,
        mean(&losses[..tenth]),
        mean(&losses[losses.len() - tenth..]),
    );
    Ok(())
}
