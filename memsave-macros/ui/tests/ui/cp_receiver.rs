use burn::nn::conv::Conv2d;
use burn::prelude::*;
use memsave::with_cp;

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&mut self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(x)
    }

    #[with_cp]
    fn borrowed(&self, x: &Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(x.clone())
    }

    #[with_cp]
    fn returns_nothing(&self, x: Tensor<B, 4>) {
        let _ = x;
    }
}

fn main() {}
