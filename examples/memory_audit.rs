//! Where the memory of a training step goes: the bytes each layer keeps alive for backward,
//! measured by the counting allocator between forward and backward (every block is charged to
//! the layer that allocated it, see `memsave::memory::scope`).
//!
//! ```text
//! cargo run --release --example memory_audit                      # ResNet-50, batch 4, 224
//! cargo run --release --example memory_audit -- --depth 18 --batch 2 --size 128
//! ```
//!
//! Part 1 audits one conv-BN-ReLU-conv chain op by op, with memsave's layers and with Burn's,
//! so that what each op keeps can be read off; part 2 audits a whole ResNet block by block.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    BatchNorm as BurnBatchNorm, BatchNormConfig as BurnBatchNormConfig, PaddingConfig2d,
};
use burn::nn::{Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use clap::Parser;
use memsave::memory::{self, live_by_tag, scope, CountingAllocator};
use memsave::nn::{BatchNorm, BatchNormConfig};
use memsave_models::resnet::{ResNet, ResNetConfig};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

type B = Autodiff<Flex>;

#[derive(Parser, Debug)]
struct Args {
    /// ResNet depth.
    #[arg(long, default_value_t = 50)]
    depth: usize,
    /// Images per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Image side, in pixels.
    #[arg(long, default_value_t = 224)]
    size: usize,
    /// Audit the step with every block checkpointed.
    #[arg(long)]
    checkpointed: bool,
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The live bytes of every tag under `prefix`, as table rows; returns their sum.
fn table(prefix: &str, activation: usize) -> i64 {
    let mut total = 0;
    for row in live_by_tag() {
        if let Some(name) = row.tag.strip_prefix(prefix) {
            println!(
                "| {name} | {:.2} | {:.2} |",
                mib(row.live),
                row.live as f64 / activation as f64
            );
            total += row.live;
        }
    }
    total
}

#[derive(Module, Debug)]
struct Chain<B: Backend> {
    conv1: Conv2d<B>,
    bn: BatchNorm<B>,
    burn_bn: BurnBatchNorm<B>,
    conv2: Conv2d<B>,
}

fn main() {
    let args = Args::parse();
    let device = Default::default();
    assert!(memory::is_counting());

    // Part 1: one chain, op by op.
    let (n, c, s) = (args.batch, 64, args.size / 4);
    let conv = || {
        Conv2dConfig::new([c, c], [3, 3])
            .with_padding(PaddingConfig2d::Same)
            .with_bias(false)
            .init::<B>(&device)
    };
    let chain = Chain {
        conv1: conv(),
        bn: BatchNormConfig::new(c).init(&device),
        burn_bn: BurnBatchNormConfig::new(c).init(&device),
        conv2: conv(),
    };
    let activation = n * c * s * s * 4;
    println!(
        "Part 1: conv-BN-ReLU-conv on [{n}, {c}, {s}, {s}] (one activation: {:.2} MiB); bytes \
         kept between forward and backward, charged to the op that allocated them\n",
        mib(activation as i64)
    );
    // A first round warms up (lazy weights, one-time caches); the second is printed.
    for round in 0..2 {
        for name in ["memsave-fused", "memsave", "burn"] {
            let scope_name = format!("{name}-{round}");
            let x = Tensor::<B, 4>::random([n, c, s, s], Distribution::Normal(0.0, 1.0), &device)
                .require_grad();
            let y = scope(&scope_name, || {
                let y = scope("conv1", || chain.conv1.forward(x.clone()));
                match name {
                    "memsave-fused" => scope("bn+relu+conv2", || {
                        chain.bn.forward_relu_conv(y, &chain.conv2)
                    }),
                    "memsave" => {
                        let y = scope("bn+relu", || chain.bn.forward_relu(y));
                        scope("conv2", || memsave::nn::conv2d(&chain.conv2, y))
                    }
                    _ => {
                        let y = scope("bn", || chain.burn_bn.forward(y));
                        let y = scope("relu", || burn::tensor::activation::relu(y));
                        scope("conv2", || chain.conv2.forward(y))
                    }
                }
            });
            if round == 1 {
                println!("| {name}: op | kept MiB | activations |");
                println!("|---|---|---|");
                let total = table(&format!("{scope_name}."), activation);
                println!(
                    "| total (the last conv's output included) | {:.2} | {:.2} |\n",
                    mib(total),
                    total as f64 / activation as f64
                );
            }
            let _ = y.sum().backward();
        }
    }

    // Part 2: a ResNet classifier, block by block, after a warm-up step (weights initialised,
    // optimizer state made).
    let mut model = Classifier {
        backbone: ResNetConfig::new(args.depth)
            .with_with_cp(args.checkpointed)
            .init::<B>(&device)
            .expect("a ResNet depth"),
        fc: LinearConfig::new(if args.depth >= 50 { 2048 } else { 512 }, 1000).init(&device),
    };
    let mut optimizer = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new()))
        .init::<B, Classifier<B>>();
    let images = Tensor::<B, 4>::random(
        [args.batch, 3, args.size, args.size],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let labels = Tensor::<B, 1, Int>::from_data(
        TensorData::new((0..args.batch as i64).collect::<Vec<_>>(), [args.batch]),
        &device,
    );
    let criterion = CrossEntropyLossConfig::new().init(&device);
    eprintln!(
        "checkpointed blocks: {}",
        model
            .backbone
            .blocks()
            .filter(|block| block.with_cp())
            .count()
    );
    memory::snapshot_peaks(true);
    for measured in [false, true] {
        let at_start: std::collections::HashMap<String, i64> = live_by_tag()
            .into_iter()
            .map(|row| (row.tag, row.live))
            .collect();
        let live_at_start = |tag: &str| at_start.get(tag).copied().unwrap_or(0);
        let baseline = memory::reset_peak();
        let logits = scope("forward", || model.forward(images.clone()));
        let loss = scope("loss", || criterion.forward(logits, labels.clone()));
        let kept = memory::current_bytes() - baseline;
        if measured {
            println!(
                "Part 2: ResNet-{} classifier, batch {}, 3x{}x{}: bytes kept for backward per \
                 block (after the forward)\n",
                args.depth, args.batch, args.size, args.size
            );
            println!("| block | kept MiB | of all |");
            println!("|---|---|---|");
            for row in live_by_tag() {
                if let Some(name) = row.tag.strip_prefix("forward.") {
                    let live = row.live - live_at_start(&row.tag);
                    println!(
                        "| {name} | {:.1} | {:.1}% |",
                        mib(live),
                        100.0 * live as f64 / kept as f64
                    );
                }
            }
            println!(
                "| all (live bytes above the step's start) | {:.1} | 100% |\n",
                mib(kept as i64)
            );
        }
        let grads = scope("backward", || {
            GradientsParams::from_grads(loss.backward(), &model)
        });
        model = scope("optimizer", || optimizer.step(0.01, model, grads));
        if measured {
            let peak = memory::peak_bytes() - baseline;
            println!(
                "Part 3: the same step's peak ({:.1} MiB above its start), by what holds it\n",
                mib(peak as i64)
            );
            println!("| allocated in | live at the peak, MiB |");
            println!("|---|---|");
            for row in memory::peak_by_tag() {
                let live_then = live_at_start(&row.tag);
                let above = row.live - live_then;
                if above.abs() >= 1 << 16 {
                    let tag = if row.tag.is_empty() {
                        "(outside any scope)"
                    } else {
                        &row.tag
                    };
                    println!("| {tag} | {:.1} |", mib(above));
                }
            }
        }
        memsave::checkpoint::join_helpers().unwrap();
    }
}

#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    backbone: ResNet<B>,
    fc: Linear<B>,
}

impl<B: memsave::Backend> Classifier<B> {
    fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let last = self.backbone.forward(images).pop().expect("four maps");
        scope("head", || {
            self.fc.forward(last.mean_dim(3).mean_dim(2).flatten(1, 3))
        })
    }
}
