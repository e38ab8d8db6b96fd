use burn::nn::conv::Conv2d;
use burn::prelude::*;

#[memsave::model]
#[derive(Module, Debug)]
struct Net<B: Backend> {
    stem: Conv2d<B>,
    #[with_cp]
    head: Conv2d<B>,
}

fn main() {}
