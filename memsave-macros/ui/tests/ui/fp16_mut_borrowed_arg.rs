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
    #[auto_fp16(apply_to = (x))]
    fn forward(&self, x: &mut Tensor<B, 1>) {
        let _ = x;
    }
}

fn main() {}
