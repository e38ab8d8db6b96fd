use burn::nn::conv::Conv2d;
use burn::prelude::*;

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

#[memsave::model]
#[derive(Module, Debug)]
struct Net<B: Backend> {
    depth: usize,
    #[with_cp]
    stem: Block<B>,
    #[with_cp]
    layer1: Vec<Block<B>>,
}

fn main() {}
