use burn::nn::Linear;
use burn::prelude::*;
use memsave::with_cp;

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    linear: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear.forward(x)
    }
}

// A container whose blocks' field is not marked: marking the container in its parent reaches
// nothing.
#[memsave::model]
#[derive(Module, Debug)]
struct Backbone<B: Backend> {
    stem: Linear<B>,
    blocks: Vec<Block<B>>,
}

#[memsave::model]
#[derive(Module, Debug)]
struct Net<B: Backend> {
    #[with_cp]
    backbone: Backbone<B>,
    head: Linear<B>,
}

fn main() {}
