//! A tiny classifier without BatchNorm, for runner tests.

use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use memsave::fp16::Fp16;
use memsave::models::classifier::ClassificationBatch;
use memsave::train::TrainModel;
use memsave::{auto_fp16, force_fp32};

#[memsave::model]
#[derive(Module, Debug)]
pub struct TinyNet<B: Backend> {
    pub conv: Conv2d<B>,
    pub fc: Linear<B>,
    /// A parameter the loss never uses (for `detect_anomalous_params`).
    pub spare: Option<Param<Tensor<B, 1>>>,
    pub fp16_enabled: Fp16,
}

impl<B: Backend> TinyNet<B> {
    pub fn new(classes: usize, spare: bool, device: &B::Device) -> Self {
        TinyNet {
            conv: Conv2dConfig::new([3, 8], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            fc: LinearConfig::new(8, classes).init(device),
            spare: spare.then(|| Param::from_tensor(Tensor::ones([2], device))),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16]
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let x = burn::tensor::activation::relu(self.conv.forward(images));
        self.fc.forward(x.mean_dim(3).mean_dim(2).flatten(1, 3))
    }

    #[force_fp32(args = (logits))]
    pub fn loss_of(&self, logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels)
    }
}

impl<B: AutodiffBackend + memsave::Backend> TrainModel<B> for TinyNet<B> {
    type Batch = ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        self.loss_of(self.forward(batch.images), batch.labels)
    }
}

/// Replaces every float parameter with values from a seeded generator (splitmix64, uniform in
/// `[-0.3, 0.3)`): the same weights whatever else draws from Flex's process-wide random stream
/// (tests run in parallel).
pub struct Seeded(pub u64);

impl<B: Backend> burn::module::ModuleMapper<B> for Seeded {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let values: Vec<f32> = (0..shape.num_elements())
            .map(|_| {
                let z = super::splitmix64(&mut self.0);
                ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.6
            })
            .collect();
        let value = Tensor::<B, D>::from_data(TensorData::new(values, shape), &tensor.device())
            .require_grad();
        Param::from_mapped_value(id, value, mapper)
    }
}
