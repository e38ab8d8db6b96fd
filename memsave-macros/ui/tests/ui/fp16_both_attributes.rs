use burn::prelude::*;
use memsave::fp16::Fp16;

#[memsave::model]
#[derive(Module, Debug)]
struct Head<B: Backend> {
    weight: burn::module::Param<Tensor<B, 1>>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Head<B> {
    #[memsave::auto_fp16]
    #[memsave::force_fp32]
    fn forward(&self, x: Tensor<B, 1>) -> Tensor<B, 1> {
        x
    }
}

fn main() {}
