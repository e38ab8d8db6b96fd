use burn::nn::Linear;
use burn::prelude::*;
use memsave::fp16::Fp16;

#[memsave::model]
#[derive(Module, Debug)]
struct Head<B: Backend> {
    #[fp16(fp32, skip)]
    linear: Linear<B>,
    #[fp16(fp32)]
    fp16_enabled: Fp16,
    #[fp16(fp23)]
    other: Linear<B>,
}

fn main() {}
