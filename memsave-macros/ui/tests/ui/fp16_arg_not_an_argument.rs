use burn::prelude::*;
use memsave::auto_fp16;
use memsave::fp16::Fp16;

#[memsave::model]
#[derive(Module, Debug)]
struct Head<B: Backend> {
    weight: burn::module::Param<Tensor<B, 1>>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Head<B> {
    #[auto_fp16(apply_to = (x, z))]
    fn forward(&self, x: Tensor<B, 1>, y: Tensor<B, 1>) -> Tensor<B, 1> {
        x + y
    }
}

fn main() {}
