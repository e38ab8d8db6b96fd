use burn::nn::conv::Conv2d;
use burn::prelude::*;
use memsave::with_cp;

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(x)
    }
}

fn main() {}
