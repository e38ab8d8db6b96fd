//! What gradient checkpointing saves on Burn 0.22, and what it costs: ResNet training steps
//! (a 1000-class head, cross-entropy, SGD with momentum) with and without every block
//! checkpointed, interleaved; memsave-models' `checkpoint_memory` example on the port's tree.
//!
//! ```text
//! cargo run --release -p memsave-models-next --example checkpoint_memory                # ResNet-50, batch 4, 3x224x224
//! cargo run --release -p memsave-models-next --example checkpoint_memory -- --balanced  # under Burn's Balanced strategy
//! cargo run --release -p memsave-models-next --example checkpoint_memory -- --depth 18 --batch 2 --size 64 --steps 1
//! ```
//!
//! After a warm-up step of each kind (the model and the optimizer state exist, gradients
//! dropped), each step's peak above the bytes live before it (the counting allocator) and its
//! time are measured, and the medians printed, with one line
//! `checkpoint: memory_ratio=<x> time_ratio=<y>` against the plain step.

use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use memsave_models_next::resnet::{ResNet, ResNetConfig};
use memsave_next::checkpoint::set_with_cp;
use memsave_next::memory::{self, CountingAllocator};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The network and its head.
#[derive(Module, Debug)]
struct Classifier {
    backbone: ResNet,
    fc: Linear,
}

impl Classifier {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let features = self.backbone.forward(images).remove(0);
        let [batch, channels, _, _] = features.dims();
        let pooled = features.mean_dim(3).mean_dim(2).reshape([batch, channels]);
        self.fc.forward(pooled)
    }
}

struct Args {
    depth: usize,
    batch: usize,
    size: usize,
    steps: usize,
    balanced: bool,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        depth: 50,
        batch: 4,
        size: 224,
        steps: 3,
        balanced: false,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        if flag == "--balanced" {
            args.balanced = true;
            continue;
        }
        let value = given
            .next()
            .ok_or_else(|| format!("`{flag}` needs a value"))?;
        let number = value
            .parse::<usize>()
            .map_err(|_| format!("`{flag}` takes a positive whole number, got `{value}`"))?;
        match flag.as_str() {
            "--depth" => args.depth = number,
            "--batch" => args.batch = number,
            "--size" => args.size = number,
            "--steps" => args.steps = number.max(1),
            other => {
                return Err(format!(
                    "unknown argument `{other}` (--depth, --batch, --size, --steps, --balanced)"
                ))
            }
        }
    }
    Ok(args)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    values[values.len() / 2]
}

fn main() {
    let args = match args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("error: {message}");
            std::process::exit(2);
        }
    };
    let device = if args.balanced {
        Device::flex().autodiff().gradient_checkpointing()
    } else {
        Device::flex().autodiff()
    };
    device.seed(0);
    let backbone = match ResNetConfig::new(args.depth)
        .with_out_indices(vec![3])
        .init(&device)
    {
        Ok(backbone) => backbone,
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(2);
        }
    };
    let channels = 512 * if args.depth >= 50 { 4 } else { 1 };
    let plain = Classifier {
        backbone,
        fc: LinearConfig::new(channels, 1000).init(&device),
    };
    let checkpointed = Classifier {
        backbone: set_with_cp(plain.backbone.clone(), true),
        fc: plain.fc.clone(),
    };
    let images = Tensor::<4>::random(
        [args.batch, 3, args.size, args.size],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let labels = Tensor::<1, Int>::from_data(
        TensorData::new(
            (0..args.batch as i64)
                .map(|i| i * 37 % 1000)
                .collect::<Vec<_>>(),
            [args.batch],
        ),
        &device,
    );
    let criterion = CrossEntropyLossConfig::new().init(&device);
    let meter = memory::meter_for(&device).expect("the counting allocator is installed");
    let optimizer = || {
        SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new()))
            .init()
    };
    // One model and optimizer each (they share no running state: the checkpointed one is a
    // copy with its own weights after the first step).
    let mut runs = [(plain, optimizer()), (checkpointed, optimizer())];
    let mut measured = [(Vec::new(), Vec::new()), (Vec::new(), Vec::new())];
    for round in 0..=args.steps {
        for (index, (model, optimizer)) in runs.iter_mut().enumerate() {
            let baseline = meter.reset_peak();
            let start = Instant::now();
            let loss = criterion.forward(model.forward(images.clone()), labels.clone());
            let grads =
                GradientsParams::from_grads(memsave_next::checkpoint::backward(loss), &*model);
            *model = optimizer.step(0.01, model.clone(), grads);
            let seconds = start.elapsed().as_secs_f64();
            let peak = meter.peak().saturating_sub(baseline);
            if round > 0 {
                measured[index].0.push(peak as f64);
                measured[index].1.push(seconds);
            }
        }
    }
    let mib = |bytes: f64| bytes / (1 << 20) as f64;
    let [plain, checkpoint] =
        measured.map(|(mut peaks, mut seconds)| (median(&mut peaks), median(&mut seconds)));
    println!(
        "ResNet-{} on Burn 0.22 (Flex{}), batch {} of 3x{}x{}, median of {} steps:",
        args.depth,
        if args.balanced { ", Balanced" } else { "" },
        args.batch,
        args.size,
        args.size,
        args.steps
    );
    println!("plain: peak {:.1} MiB, {:.2} s", mib(plain.0), plain.1);
    println!(
        "checkpoint: peak {:.1} MiB, {:.2} s",
        mib(checkpoint.0),
        checkpoint.1
    );
    println!(
        "checkpoint: memory_ratio={:.3} time_ratio={:.3}",
        checkpoint.0 / plain.0,
        checkpoint.1 / plain.1
    );
}
