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
    fn nothing(&self) -> Tensor<B, 1> {
        Tensor::zeros([1], &Default::default())
    }

    /// A plain number is a constant of the segment; a string is not a value it can keep.
    #[with_cp]
    fn counts(&self, n: usize, name: String) -> Tensor<B, 1> {
        Tensor::zeros([n + name.len()], &Default::default())
    }
}

fn main() {}
