use burn::nn::{LayerNorm, Linear};
use burn::prelude::*;
use memsave::fp16::Fp16;

/// Burn's LayerNorm in a model with an fp16 flag: its variance overflows f16.
#[memsave::model]
#[derive(Module, Debug)]
struct Encoder<B: Backend> {
    linear: Linear<B>,
    norm: LayerNorm<B>,
    fp16_enabled: Fp16,
}

fn main() {}
