use burn::nn::BatchNorm;
use burn::prelude::*;
use memsave::fp16::Fp16;

#[memsave::model]
#[derive(Module, Debug)]
struct ConvBn<B: Backend> {
    conv: burn::nn::conv::Conv2d<B>,
    bn: BatchNorm<B>,
    fp16_enabled: Fp16,
}

fn main() {}
