use burn::prelude::*;

#[memsave::model]
#[derive(Module, Debug)]
struct Head<B: Backend> {
    weight: burn::module::Param<Tensor<B, 1>>,
    fp16_enabled: bool,
}

fn main() {}
