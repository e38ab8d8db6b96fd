//! Annotate your own model with memsave's DSL, wrap it for fp16, and take one training step on
//! the CPU, printing each tensor's dtype at each stage.
//!
//! ```text
//! cargo run --release --example custom_model
//! ```

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use memsave::fp16::{wrap_fp16_model, Fp16, Precision};
use memsave::nn::{BatchNorm, BatchNormConfig};
use memsave::{auto_fp16, force_fp32};

/// A conv-BN-ReLU block. `#[memsave::model]` lets `wrap_fp16_model` reach its fields and switch
/// its `fp16_enabled` flag on.
#[memsave::model]
#[derive(Module, Debug)]
pub struct ConvBlock<B: Backend> {
    conv: Conv2d<B>,
    bn: BatchNorm<B>,
    relu: Relu,
    fp16_enabled: Fp16,
}

impl<B: Backend> ConvBlock<B> {
    pub fn new(channels: [usize; 2], device: &B::Device) -> Self {
        ConvBlock {
            conv: Conv2dConfig::new(channels, [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            bn: BatchNormConfig::new(channels[1]).init(device),
            relu: Relu::new(),
            fp16_enabled: Fp16::Off,
        }
    }

    /// `[N, C_in, H, W]` -> `[N, C_out, H, W]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = self.conv.forward(x);
        println!("  conv output          {:?}", x.dtype());
        let x = self.bn.forward(x);
        println!("  batch-norm output    {:?} (computed in fp32)", x.dtype());
        self.relu.forward(x)
    }
}

/// A tiny classifier: two blocks, global average pooling and a linear layer.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Classifier<B: Backend> {
    blocks: Vec<ConvBlock<B>>,
    fc: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Classifier<B> {
    pub fn new(classes: usize, device: &B::Device) -> Self {
        Classifier {
            blocks: vec![
                ConvBlock::new([3, 16], device),
                ConvBlock::new([16, 32], device),
            ],
            fc: LinearConfig::new(32, classes).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    /// Images `[N, 3, H, W]` -> logits `[N, classes]`. With the flag on, the fp32 images are
    /// cast to half on the way in.
    #[auto_fp16(apply_to = (images))]
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        println!("  forward input        {:?}", images.dtype());
        let mut x = images;
        for block in &self.blocks {
            x = block.forward(x);
        }
        let pooled = x.mean_dim(3).mean_dim(2).flatten(1, 3);
        self.fc.forward(pooled)
    }

    /// Cross-entropy of `logits` `[N, classes]` against `labels` `[N]`, always in fp32.
    #[force_fp32(args = (logits))]
    pub fn loss(&self, logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        println!("  loss input           {:?}", logits.dtype());
        let log_probs = burn::tensor::activation::log_softmax(logits, 1);
        let picked = log_probs.gather(1, labels.unsqueeze_dim(1));
        picked.mean().neg()
    }
}

type Train = Autodiff<Flex>;

fn main() {
    let device = Default::default();
    let model = Classifier::<Train>::new(4, &device);

    println!("wrap_fp16_model(model, Precision::F16)");
    let model = wrap_fp16_model(model, Precision::F16);
    println!("  fp16_enabled         {}", model.fp16_enabled);
    println!(
        "  conv weight          {:?}",
        model.blocks[0].conv.weight.val().dtype()
    );
    println!(
        "  batch-norm gamma     {:?}",
        model.blocks[0].bn.gamma.val().dtype()
    );
    println!("  fc weight            {:?}", model.fc.weight.val().dtype());

    let images =
        Tensor::<Train, 4>::random([8, 3, 16, 16], Distribution::Normal(0.0, 1.0), &device);
    let labels = Tensor::<Train, 1, Int>::from_ints([0, 1, 2, 3, 0, 1, 2, 3], &device);
    println!("images                 {:?}", images.dtype());

    println!("forward");
    let logits = model.forward(images.clone());
    println!("  logits               {:?}", logits.dtype());
    let loss = model.loss(logits, labels.clone());
    println!(
        "  loss                 {:?} = {:.4}",
        loss.dtype(),
        loss.clone().into_scalar()
    );

    println!("backward");
    let grads = loss.backward();
    let conv_grad = model.blocks[0]
        .conv
        .weight
        .grad(&grads)
        .expect("conv is trained");
    let bn_grad = model.blocks[0]
        .bn
        .gamma
        .grad(&grads)
        .expect("bn is trained");
    println!("  conv weight gradient {:?}", conv_grad.dtype());
    println!("  bn gamma gradient    {:?}", bn_grad.dtype());

    println!("SGD step");
    let grads = GradientsParams::from_grads(grads, &model);
    let mut optimizer = SgdConfig::new().init::<Train, Classifier<Train>>();
    let model = optimizer.step(0.1, model, grads);
    println!(
        "  conv weight          {:?}",
        model.blocks[0].conv.weight.val().dtype()
    );

    let loss = model.loss(model.forward(images), labels);
    println!("loss after one step    {:.4}", loss.into_scalar());

    // The same model, evaluated without autodiff: the flag travels with it.
    let inference = model.valid();
    println!("valid() keeps the flag {}", inference.fp16_enabled);
    assert_eq!(inference.fc.weight.val().dtype(), DType::F16);
}
