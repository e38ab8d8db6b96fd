//! An image classifier: a ResNet backbone, global average pooling and a linear layer, trained
//! with cross-entropy (the loss always in fp32).

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::{Backend, Int, Tensor};
use burn::tensor::backend::AutodiffBackend;

use crate::memsave::fp16::Fp16;
use crate::memsave::train::TrainModel;
use crate::memsave::{auto_fp16, force_fp32};
use crate::resnet::{ResNet, ResNetConfig};

/// Images and their class labels.
#[derive(Clone, Debug)]
pub struct ClassificationBatch<B: Backend> {
    /// `[N, C, H, W]`, fp32.
    pub images: Tensor<B, 4>,
    /// `[N]`, in `0..num_classes`.
    pub labels: Tensor<B, 1, Int>,
}

/// The classification head: a linear layer on pooled features, and the loss.
#[crate::memsave::model]
#[derive(Module, Debug)]
pub struct ClsHead<B: Backend> {
    fc: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> ClsHead<B> {
    /// Pooled features `[N, C]` -> logits `[N, classes]`.
    pub fn forward(&self, features: Tensor<B, 2>) -> Tensor<B, 2> {
        crate::memsave::nn::linear(&self.fc, features)
    }

    /// Mean cross-entropy of `logits` `[N, classes]` against `labels` `[N]`, in fp32.
    #[force_fp32(args = (logits))]
    pub fn loss(&self, logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels)
    }
}

/// ResNet + global average pooling + linear.
#[crate::memsave::model]
#[derive(Module, Debug)]
pub struct ImageClassifier<B: Backend> {
    /// `set_with_cp` and the planner reach the backbone's blocks (`backbone.layer1.0`).
    #[with_cp]
    backbone: ResNet<B>,
    head: ClsHead<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> ImageClassifier<B> {
    /// A classifier over `num_classes` classes on the given backbone.
    pub fn new(
        backbone: &ResNetConfig,
        num_classes: usize,
        device: &B::Device,
    ) -> crate::memsave::Result<Self> {
        if num_classes < 2 {
            return Err(crate::memsave::Error::invalid(
                "num_classes",
                format!("a classifier needs at least 2 classes, got {num_classes}"),
            ));
        }
        let width = backbone.out_channels().map_err(|e| e.within("backbone"))?;
        Ok(ImageClassifier {
            backbone: backbone.init(device).map_err(|e| e.within("backbone"))?,
            head: ClsHead {
                fc: LinearConfig::new(width, num_classes).init(device),
                fp16_enabled: Fp16::Off,
            },
            fp16_enabled: Fp16::Off,
        })
    }

    /// The backbone.
    pub fn backbone(&self) -> &ResNet<B> {
        &self.backbone
    }
}

impl<B: crate::memsave::Backend> ImageClassifier<B> {
    /// Images `[N, C, H, W]` -> logits `[N, classes]`.
    #[auto_fp16(apply_to = (images))]
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let last = self
            .backbone
            .forward(images)
            .pop()
            .expect("the backbone returns four feature maps");
        self.head
            .forward(last.mean_dim(3).mean_dim(2).flatten(1, 3))
    }
}

impl<B: crate::memsave::Backend> ImageClassifier<B> {
    /// The mean cross-entropy of `logits` against `labels`, in fp32.
    pub fn head_loss(&self, logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        self.head.loss(logits, labels)
    }
}

impl<B: AutodiffBackend + crate::memsave::Backend> TrainModel<B> for ImageClassifier<B> {
    type Batch = ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        let logits = self.forward(batch.images);
        self.head.loss(logits, batch.labels)
    }
}
