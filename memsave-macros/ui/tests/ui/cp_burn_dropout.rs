use burn::backend::{Autodiff, Flex};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::prelude::*;
use memsave::with_cp;

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    linear: Linear<B>,
    dropout: Dropout,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.dropout.forward(self.linear.forward(x))
    }
}

fn main() {
    type AB = Autodiff<Flex>;
    let device = Default::default();
    let block = Block {
        linear: LinearConfig::new(4, 4).init::<AB>(&device),
        dropout: DropoutConfig::new(0.1).init(),
        with_cp: true,
    };
    let _ = block.forward(Tensor::zeros([2, 4], &device));
}
