use burn::prelude::*;
use memsave::fp16::Fp16;

#[memsave::model]
#[derive(Module, Debug)]
struct Head<B: Backend> {
    #[fp16(skp)]
    linear: burn::nn::Linear<B>,
    fp16_enabled: Fp16,
}

fn main() {}
