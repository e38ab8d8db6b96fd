//! What gradient checkpointing saves, and what it costs: ResNet-50 training steps with and
//! without checkpointing every block, interleaved.
//!
//! ```text
//! cargo run --release --example checkpoint_memory                    # CPU, batch 4, 3x224x224
//! cargo run --release --features cuda --example checkpoint_memory -- --device cuda
//! cargo run --release --example checkpoint_memory -- --strategy balanced   # Burn's BalancedCheckpointing
//! ```
//!
//! After a warm-up step of each kind (model and optimizer state exist, gradients dropped), it
//! measures each step's peak memory above that baseline (CPU: live heap bytes, counted by
//! memsave's allocator; CUDA: CubeCL's pool reservation) and its time, then prints the medians.
//! It prints one line `<variant>: memory_ratio=<x> time_ratio=<y>` per variant against the
//! plain fp32 step: `checkpoint`, and with `--f16` also `f16` and `f16+checkpoint` (the model
//! wrapped by `wrap_fp16_model`, SGD straight on its half weights).

use std::time::Instant;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Distribution;
use clap::{Parser, ValueEnum};
use memsave::auto_fp16;
use memsave::checkpoint::{join_helpers, set_with_cp};
use memsave::fp16::{wrap_fp16_model, Fp16, Precision};
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
    /// Also measure the model wrapped for f16 (`wrap_fp16_model`), plain and checkpointed.
    #[arg(long)]
    f16: bool,
    /// Burn's autodiff checkpoint strategy under memsave's (`balanced`: Burn's
    /// `BalancedCheckpointing`, which recomputes memory-bound ops).
    #[arg(long, value_enum, default_value = "none")]
    strategy: Strategy,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Strategy {
    /// `NoCheckpointing` (Burn's default).
    None,
    /// `BalancedCheckpointing`.
    Balanced,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceKind {
    Cpu,
    Cuda,
}

/// A ResNet with a classification head: global average pooling and a linear layer.
#[memsave::model]
#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    backbone: ResNet<B>,
    fc: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> Classifier<B> {
    /// Images `[N, 3, H, W]` -> logits `[N, classes]`, in fp32.
    #[auto_fp16(apply_to = (images), out_fp32)]
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

/// One configuration of the step.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Variant {
    half: Option<Precision>,
    checkpointed: bool,
}

impl Variant {
    fn name(self) -> String {
        let precision = match self.half {
            None => "fp32".to_string(),
            Some(precision) => precision.to_string(),
        };
        if self.checkpointed {
            format!("{precision}, every block checkpointed")
        } else {
            format!("{precision}, plain")
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
    let model = Classifier {
        backbone: ResNetConfig::new(args.depth).init::<B>(device)?,
        fc: LinearConfig::new(2048.min(512 * if args.depth >= 50 { 4 } else { 1 }), 1000)
            .init(device),
        fp16_enabled: Fp16::Off,
    };
    let variants: Vec<Variant> = [false, true]
        .into_iter()
        .flat_map(|half| {
            [false, true].map(|checkpointed| Variant {
                half: (half && args.f16).then_some(Precision::F16),
                checkpointed,
            })
        })
        .filter(|variant| args.f16 || variant.half.is_none())
        .collect::<Vec<_>>();
    let mut variants: Vec<Variant> =
        variants
            .into_iter()
            .fold(Vec::new(), |mut unique, variant| {
                if !unique.contains(&variant) {
                    unique.push(variant);
                }
                unique
            });
    // One model and optimizer per precision (SGD straight on the half weights, as MMCV's
    // `wrap_fp16_model` + SGD would).
    let new_optimizer = || {
        SgdConfig::new()
            .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
            .init::<B, Classifier<B>>()
    };
    let mut models = vec![(None, model.clone(), new_optimizer())];
    if args.f16 {
        models.push((
            Some(Precision::F16),
            wrap_fp16_model(model, Precision::F16),
            new_optimizer(),
        ));
    }
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

    let mut step = |variant: Variant, meter: &mut dyn Meter<B>| {
        let slot = models
            .iter_mut()
            .find(|(half, _, _)| *half == variant.half)
            .expect("a model per precision");
        let model = slot.1.clone().with_cp(variant.checkpointed);
        meter.before_step(device);
        let start = Instant::now();
        let loss = criterion.forward(model.forward(images.clone()), labels.clone());
        let _ = B::sync(device);
        let forward = start.elapsed().as_secs_f64();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let _ = B::sync(device);
        join_helpers().unwrap();
        let backward = start.elapsed().as_secs_f64() - forward;
        slot.1 = slot.2.step(0.01, model, grads);
        let _ = B::sync(device);
        let seconds = start.elapsed().as_secs_f64();
        (
            meter.peak_above_baseline(device),
            seconds,
            [forward, backward],
        )
    };

    eprintln!(
        "ResNet-{} batch {} x 3x{}x{}: warm-up",
        args.depth, args.batch, args.size, args.size
    );
    for variant in &variants {
        step(*variant, meter);
    }
    let mut measured: Vec<Measured> = variants
        .iter()
        .map(|_| Measured {
            peak: Vec::new(),
            seconds: Vec::new(),
        })
        .collect();
    for round in 0..args.steps {
        // Interleaved, in a rotating order: no variant always runs first.
        let order: Vec<usize> = (0..variants.len())
            .map(|i| (i + round) % variants.len())
            .collect();
        for index in order {
            let (peak, seconds, [forward, backward]) = step(variants[index], meter);
            eprintln!(
                "  step {} {:>32}: peak {:8.1} MiB above baseline, {:6.2} s (forward {:.2} s, backward {:.2} s)",
                round + 1,
                variants[index].name(),
                memory::mib(peak as usize),
                seconds,
                forward,
                backward
            );
            measured[index].peak.push(peak);
            measured[index].seconds.push(seconds);
        }
    }
    variants.truncate(measured.len());

    let plain = &measured[0];
    let (plain_peak, plain_time) = (median(&plain.peak), median(&plain.seconds));
    println!(
        "| ResNet-{}, batch {}, 3x{}x{}, {:?} | peak above baseline (median) | step time (median) | memory / fp32 plain | time / fp32 plain |",
        args.depth, args.batch, args.size, args.size, args.device
    );
    println!("|---|---|---|---|---|");
    let mut ratios = Vec::new();
    for (variant, m) in variants.iter().zip(&measured) {
        let (peak, time) = (median(&m.peak), median(&m.seconds));
        let (memory_ratio, time_ratio) = (peak as f64 / plain_peak as f64, time / plain_time);
        println!(
            "| {} | {:.1} MiB | {:.2} s | {memory_ratio:.2} | {time_ratio:.2} |",
            variant.name(),
            memory::mib(peak as usize),
            time
        );
        ratios.push((*variant, memory_ratio, time_ratio));
    }
    for (variant, memory_ratio, time_ratio) in ratios {
        let name = match (variant.half, variant.checkpointed) {
            (None, false) => continue,
            (None, true) => "checkpoint".to_string(),
            (Some(p), false) => p.to_string(),
            (Some(p), true) => format!("{p}+checkpoint"),
        };
        println!("{name}: memory_ratio={memory_ratio:.2} time_ratio={time_ratio:.2}");
    }
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
            let meter = &mut HeapMeter { baseline: 0 };
            match args.strategy {
                Strategy::None => run::<Autodiff<Flex>>(&args, &device, meter)?,
                Strategy::Balanced => {
                    run::<Autodiff<Flex, BalancedCheckpointing>>(&args, &device, meter)?
                }
            }
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
