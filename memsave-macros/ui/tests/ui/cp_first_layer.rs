use burn::backend::{Autodiff, Flex};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::prelude::*;
use memsave::fp16::Fp16;
use memsave::{auto_fp16, with_cp};

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(x)
    }
}

#[memsave::model]
#[derive(Module, Debug)]
struct Net<B: Backend> {
    #[with_cp]
    layer1: Vec<Block<B>>,
    #[with_cp]
    stem: Block<B>,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> Net<B> {
    /// The network's input goes straight into `stem`, which is marked `#[with_cp]`.
    #[auto_fp16]
    fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = self.stem.forward(images);
        for block in &self.layer1 {
            x = block.forward(x);
        }
        x
    }
}

fn main() {
    type AB = Autodiff<Flex>;
    let device = Default::default();
    let block = || Block {
        conv: Conv2dConfig::new([3, 3], [3, 3]).init::<AB>(&device),
        with_cp: false,
    };
    let net = Net {
        layer1: vec![block()],
        stem: block(),
        fp16_enabled: Fp16::Off,
    };
    let _ = net.forward(Tensor::zeros([1, 3, 8, 8], &device));
}
