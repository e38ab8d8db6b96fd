use burn::prelude::*;
use memsave::auto_fp16;

#[derive(Module, Debug)]
struct Plain<B: Backend> {
    weight: burn::module::Param<Tensor<B, 1>>,
}

impl<B: Backend> Plain<B> {
    #[auto_fp16]
    fn forward(&self, x: Tensor<B, 1>) -> Tensor<B, 1> {
        x
    }
}

fn main() {}
