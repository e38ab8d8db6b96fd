use burn::nn::conv::Conv2d;
use burn::prelude::*;

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    conv: Conv2d<B>,
    with_cp: u8,
}

fn main() {}
