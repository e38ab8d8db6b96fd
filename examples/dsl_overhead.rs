//! The cost of memsave's DSL when every strategy is off: a forward through a model annotated
//! with `#[memsave::model]`, `#[auto_fp16]` and `#[force_fp32]` (flags off) against the same
//! forward written by hand. Rounds are interleaved; the medians are compared.
//!
//! ```text
//! cargo run --release --example dsl_overhead
//! ```
//! Its last line is `dsl_overhead: ratio=<annotated / hand>`.

use std::time::Instant;

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{PaddingConfig2d, Relu};
use burn::prelude::*;
use burn::tensor::Distribution;
use memsave::fp16::Fp16;
use memsave::nn::{BatchNorm, BatchNormConfig};
use memsave::{auto_fp16, force_fp32};

type B = Flex;

#[memsave::model]
#[derive(Module, Debug)]
struct Annotated<B: Backend> {
    convs: Vec<Conv2d<B>>,
    norms: Vec<BatchNorm<B>>,
    relu: Relu,
    fp16_enabled: Fp16,
}

impl<B: Backend> Annotated<B> {
    #[auto_fp16]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = x;
        for (conv, norm) in self.convs.iter().zip(&self.norms) {
            x = self.relu.forward(norm.forward(conv.forward(x)));
        }
        x
    }

    #[force_fp32]
    fn loss(&self, x: Tensor<B, 4>) -> Tensor<B, 1> {
        x.mean()
    }
}

#[derive(Module, Debug)]
struct Hand<B: Backend> {
    convs: Vec<Conv2d<B>>,
    norms: Vec<BatchNorm<B>>,
    relu: Relu,
}

impl<B: Backend> Hand<B> {
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = x;
        for (conv, norm) in self.convs.iter().zip(&self.norms) {
            x = self.relu.forward(norm.forward(conv.forward(x)));
        }
        x
    }

    fn loss(&self, x: Tensor<B, 4>) -> Tensor<B, 1> {
        x.mean()
    }
}

fn layers(device: &burn::backend::flex::FlexDevice) -> (Vec<Conv2d<B>>, Vec<BatchNorm<B>>) {
    let convs = (0..4)
        .map(|_| {
            Conv2dConfig::new([8, 8], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        })
        .collect();
    let norms = (0..4)
        .map(|_| BatchNormConfig::new(8).init(device))
        .collect();
    (convs, norms)
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    let device = Default::default();
    let (convs, norms) = layers(&device);
    let hand = Hand {
        convs: convs.clone(),
        norms: norms.clone(),
        relu: Relu::new(),
    };
    let annotated = Annotated {
        convs,
        norms,
        relu: Relu::new(),
        fp16_enabled: Fp16::Off,
    };
    let x = Tensor::<B, 4>::random([2, 8, 16, 16], Distribution::Normal(0.0, 1.0), &device);

    let (rounds, iters) = (41, 50);
    let time = |f: &dyn Fn() -> f32| {
        let start = Instant::now();
        let mut sink = 0.0;
        for _ in 0..iters {
            sink += f();
        }
        std::hint::black_box(sink);
        start.elapsed().as_secs_f64() / iters as f64
    };
    let run_hand = || hand.loss(hand.forward(x.clone())).into_scalar();
    let run_annotated = || annotated.loss(annotated.forward(x.clone())).into_scalar();
    // Warm-up, then interleaved rounds so that drift hits both alike.
    time(&run_hand);
    time(&run_annotated);
    let (mut hand_times, mut annotated_times) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            hand_times.push(time(&run_hand));
            annotated_times.push(time(&run_annotated));
        } else {
            annotated_times.push(time(&run_annotated));
            hand_times.push(time(&run_hand));
        }
    }
    let (hand_median, annotated_median) = (median(hand_times), median(annotated_times));
    println!("| forward + loss, batch 2, 4 x conv-BN-ReLU 8x16x16 | median |");
    println!("|---|---|");
    println!("| written by hand | {:.1} us |", hand_median * 1e6);
    println!(
        "| memsave DSL, strategies off | {:.1} us |",
        annotated_median * 1e6
    );
    println!("dsl_overhead: ratio={:.3}", annotated_median / hand_median);
}
