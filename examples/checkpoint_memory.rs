//! What gradient checkpointing saves, and what it costs: ResNet-50 training steps with and
//! without checkpointing every block, interleaved.
//!
//! ```text
//! cargo run --release --example checkpoint_memory                    # CPU, batch 4, 3x224x224
//! cargo run --release --features cuda --example checkpoint_memory -- --device cuda
//! ```
//!
//! After a warm-up step of each kind (model and optimizer state exist, gradients dropped), it
//! measures each step's peak memory above that baseline (CPU: live heap bytes, counted by
//! memsave's allocator; CUDA: CubeCL's pool reservation) and its time, then prints the medians.
//! Its last line is `checkpoint: memory_ratio=<x> time_ratio=<y>` (checkpointed over plain).

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Distribution;
use clap::{Parser, ValueEnum};
use memsave::checkpoint::{join_helpers, set_with_cp};
use memsave::memory::{self, CountingAllocator};
use memsave_models::resnet::{ResNet, ResNetConfig};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser, Debug)]
struct Args {
    /// Where to train.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// ResNet depth.
    #[arg(long, default_value_t = 50)]
    depth: usize,
    /// Images per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Image side, in pixels.
    #[arg(long, default_value_t = 224)]
    size: usize,
    /// Measured steps of each kind (after one warm-up step of each).
    #[arg(long, default_value_t = 3)]
    steps: usize,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceKind {
    Cpu,
    Cuda,
}

/// A ResNet with a classification head: global average pooling and a linear layer.
#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    backbone: ResNet<B>,
    fc: Linear<B>,
}

impl<B: memsave::Backend> Classifier<B> {
    /// Images `[N, 3, H, W]` -> logits `[N, classes]`.
    fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let last = self
            .backbone
            .forward(images)
            .pop()
            .expect("four feature maps");
        self.fc.forward(last.mean_dim(3).mean_dim(2).flatten(1, 3))
    }

    fn with_cp(self, on: bool) -> Self {
        Classifier {
            backbone: set_with_cp(self.backbone, on),
            ..self
        }
    }
}

/// Peak memory of one step, above the baseline.
trait Meter<B: Backend> {
    fn before_step(&mut self, device: &B::Device);
    fn peak_above_baseline(&mut self, device: &B::Device) -> u64;
}

/// Live heap bytes, counted by memsave's allocator.
struct HeapMeter {
    baseline: usize,
}

impl<B: Backend> Meter<B> for HeapMeter {
    fn before_step(&mut self, _device: &B::Device) {
        self.baseline = memory::reset_peak();
    }

    fn peak_above_baseline(&mut self, _device: &B::Device) -> u64 {
        memory::peak_bytes().saturating_sub(self.baseline) as u64
    }
}

#[cfg(feature = "cuda")]
struct PoolMeter {
    baseline: u64,
}

#[cfg(feature = "cuda")]
impl Meter<Autodiff<burn::backend::Cuda>> for PoolMeter {
    fn before_step(&mut self, device: &burn::backend::cuda::CudaDevice) {
        let _ = <Autodiff<burn::backend::Cuda> as Backend>::sync(device);
        <Autodiff<burn::backend::Cuda> as Backend>::memory_cleanup(device);
        self.baseline = memory::cuda::pool_usage(device).map_or(0, |(_, reserved)| reserved);
    }

    fn peak_above_baseline(&mut self, device: &burn::backend::cuda::CudaDevice) -> u64 {
        let _ = <Autodiff<burn::backend::Cuda> as Backend>::sync(device);
        let reserved = memory::cuda::pool_usage(device).map_or(0, |(_, reserved)| reserved);
        reserved.saturating_sub(self.baseline)
    }
}

struct Measured {
    peak: Vec<u64>,
    seconds: Vec<f64>,
}

fn median<T: Copy + PartialOrd>(values: &[T]) -> T {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    sorted[sorted.len() / 2]
}

fn run<B: AutodiffBackend + memsave::Backend>(
    args: &Args,
    device: &B::Device,
    meter: &mut dyn Meter<B>,
) -> Result<(), memsave::Error> {
    let mut model = Classifier {
        backbone: ResNetConfig::new(args.depth).init::<B>(device)?,
        fc: LinearConfig::new(2048.min(512 * if args.depth >= 50 { 4 } else { 1 }), 1000)
            .init(device),
    };
    let mut optimizer = SgdConfig::new()
        .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
        .init::<B, Classifier<B>>();
    let images = Tensor::<B, 4>::random(
        [args.batch, 3, args.size, args.size],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let labels = Tensor::<B, 1, Int>::from_data(
        TensorData::new(
            (0..args.batch as i64)
                .map(|i| i * 37 % 1000)
                .collect::<Vec<_>>(),
            [args.batch],
        ),
        device,
    );
    let criterion = CrossEntropyLossConfig::new().init(device);

    let mut step = |model: Classifier<B>, checkpointed: bool, meter: &mut dyn Meter<B>| {
        let model = model.with_cp(checkpointed);
        meter.before_step(device);
        let start = Instant::now();
        let loss = criterion.forward(model.forward(images.clone()), labels.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = optimizer.step(0.01, model, grads);
        let _ = B::sync(device);
        join_helpers();
        let seconds = start.elapsed().as_secs_f64();
        (model, meter.peak_above_baseline(device), seconds)
    };

    eprintln!(
        "ResNet-{} batch {} x 3x{}x{}: warm-up",
        args.depth, args.batch, args.size, args.size
    );
    model = step(model, false, meter).0;
    model = step(model, true, meter).0;

    let mut plain = Measured {
        peak: Vec::new(),
        seconds: Vec::new(),
    };
    let mut checkpointed = Measured {
        peak: Vec::new(),
        seconds: Vec::new(),
    };
    for round in 0..args.steps {
        for cp in if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            let (next, peak, seconds) = step(model, cp, meter);
            model = next;
            eprintln!(
                "  step {} {:>12}: peak {:8.1} MiB above baseline, {:6.2} s",
                round + 1,
                if cp { "checkpointed" } else { "plain" },
                memory::mib(peak as usize),
                seconds
            );
            let into = if cp { &mut checkpointed } else { &mut plain };
            into.peak.push(peak);
            into.seconds.push(seconds);
        }
    }

    let (plain_peak, cp_peak) = (median(&plain.peak), median(&checkpointed.peak));
    let (plain_time, cp_time) = (median(&plain.seconds), median(&checkpointed.seconds));
    let memory_ratio = cp_peak as f64 / plain_peak as f64;
    let time_ratio = cp_time / plain_time;
    println!(
        "| ResNet-{}, batch {}, 3x{}x{}, {:?} | peak above baseline (median) | step time (median) |",
        args.depth, args.batch, args.size, args.size, args.device
    );
    println!("|---|---|---|");
    println!(
        "| plain | {:.1} MiB | {:.2} s |",
        memory::mib(plain_peak as usize),
        plain_time
    );
    println!(
        "| every block checkpointed | {:.1} MiB | {:.2} s |",
        memory::mib(cp_peak as usize),
        cp_time
    );
    println!("| ratio | {memory_ratio:.2} | {time_ratio:.2} |");
    println!("checkpoint: memory_ratio={memory_ratio:.2} time_ratio={time_ratio:.2}");
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.steps == 0 || args.batch == 0 || args.size < 32 {
        return Err("--steps and --batch must be at least 1, --size at least 32".into());
    }
    match args.device {
        DeviceKind::Cpu => {
            if !memory::is_counting() {
                return Err("the counting allocator is not installed".into());
            }
            let device = Default::default();
            run::<Autodiff<Flex>>(&args, &device, &mut HeapMeter { baseline: 0 })?;
        }
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            let device = burn::backend::cuda::CudaDevice::default();
            run::<Autodiff<burn::backend::Cuda>>(&args, &device, &mut PoolMeter { baseline: 0 })?;
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => {
            return Err("this build has no CUDA: rebuild with `--features cuda`".into());
        }
    }
    Ok(())
}
