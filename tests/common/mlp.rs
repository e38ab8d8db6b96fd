//! A multi-layer perceptron with memsave's dropout, on flattened images: large layers (their
//! state quantized in 8 bits, their gradients worth freeing) and random draws.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use memsave::fp16::{Fp16, PrecisionExt};
use memsave::models::classifier::ClassificationBatch;
use memsave::nn::{Dropout, DropoutConfig};
use memsave::train::TrainModel;

/// An MLP with dropout (memsave's), on flattened images.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    layers: Vec<Linear<B>>,
    dropout: Dropout,
    out: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Mlp<B> {
    pub fn new(input: usize, width: usize, depth: usize, dropout: f64, device: &B::Device) -> Self {
        let mut layers = vec![LinearConfig::new(input, width).init(device)];
        for _ in 1..depth {
            layers.push(LinearConfig::new(width, width).init(device));
        }
        Mlp {
            layers,
            dropout: DropoutConfig::new(dropout).init(),
            out: LinearConfig::new(width, 4).init(device),
            fp16_enabled: Fp16::Off,
        }
    }
}

impl<B: AutodiffBackend + memsave::Backend> TrainModel<B> for Mlp<B> {
    type Batch = ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        let mut x = batch.images.flatten::<2>(1, 3);
        // Under mixed precision the layers are half: their input too, the loss in fp32.
        let precision = self.fp16_enabled.precision();
        if let Some(precision) = precision {
            x = x.cast(precision.dtype());
        }
        for layer in &self.layers {
            x = self
                .dropout
                .forward(burn::tensor::activation::relu(layer.forward(x)));
        }
        let mut logits = self.out.forward(x);
        if precision.is_some() {
            logits = logits.cast(burn::tensor::DType::F32);
        }
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.labels)
    }
}
