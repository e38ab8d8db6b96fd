use burn::prelude::*;
use memsave::{auto_fp16, force_fp32};
use memsave::fp16::Fp16;

#[memsave::model]
#[derive(Module, Debug)]
struct Head<B: Backend> {
    weight: burn::module::Param<Tensor<B, 1>>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Head<B> {
    #[auto_fp16(out_fp16)]
    fn forward(&self, x: Tensor<B, 1>) -> Tensor<B, 1> {
        x
    }

    #[force_fp32(aply_to = (x))]
    fn loss(&self, x: Tensor<B, 1>) -> Tensor<B, 1> {
        x
    }
}

fn main() {}
