use burn::prelude::*;
use memsave::{auto_fp16, force_fp32};

#[auto_fp16]
fn free_function<B: Backend>(x: Tensor<B, 1>) -> Tensor<B, 1> {
    x
}

struct Head;

impl Head {
    #[force_fp32]
    fn associated<B: Backend>(x: Tensor<B, 1>) -> Tensor<B, 1> {
        x
    }
}

fn main() {}
