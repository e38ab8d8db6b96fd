//! An image classifier on Burn 0.22: a ResNet backbone, global average pooling and a linear
//! layer, trained with cross-entropy (the loss always in fp32).

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;

use crate::memsave::fp16::Fp16;
use crate::memsave::train::TrainModel;
use crate::resnet::{ResNet, ResNetConfig};
use memsave_macros::{auto_fp16, force_fp32};

/// Images and their class labels.
#[derive(Clone, Debug)]
pub struct ClassificationBatch {
    /// `[N, C, H, W]`, fp32.
    pub images: Tensor<4>,
    /// `[N]`, in `0..num_classes`.
    pub labels: Tensor<1, Int>,
}

/// The classification head: a linear layer on pooled features, and the loss.
#[memsave_macros::model]
#[derive(Module, Debug)]
pub struct ClsHead {
    fc: Linear,
    fp16_enabled: Fp16,
}

impl ClsHead {
    /// Pooled features `[N, C]` -> logits `[N, classes]`.
    pub fn forward(&self, features: Tensor<2>) -> Tensor<2> {
        self.fc.forward(features)
    }

    /// Mean cross-entropy of `logits` `[N, classes]` against `labels` `[N]`, in fp32.
    #[force_fp32(args = (logits))]
    pub fn loss(&self, logits: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels)
    }
}

/// ResNet + global average pooling + linear.
#[memsave_macros::model]
#[derive(Module, Debug)]
pub struct ImageClassifier {
    /// `set_with_cp` and the planner reach the backbone's blocks (`backbone.layer1.0`).
    #[with_cp]
    backbone: ResNet,
    head: ClsHead,
    fp16_enabled: Fp16,
}

impl ImageClassifier {
    /// A classifier over `num_classes` classes on the given backbone.
    pub fn new(
        backbone: &ResNetConfig,
        num_classes: usize,
        device: &Device,
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
    pub fn backbone(&self) -> &ResNet {
        &self.backbone
    }
}

impl ImageClassifier {
    /// Images `[N, C, H, W]` -> logits `[N, classes]`.
    #[auto_fp16(apply_to = (images))]
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let last = self
            .backbone
            .forward(images)
            .pop()
            .expect("the backbone returns four feature maps");
        self.head
            .forward(last.mean_dim(3).mean_dim(2).flatten(1, 3))
    }
}

impl ImageClassifier {
    /// The mean cross-entropy of `logits` against `labels`, in fp32.
    pub fn head_loss(&self, logits: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
        self.head.loss(logits, labels)
    }
}

impl TrainModel for ImageClassifier {
    type Batch = ClassificationBatch;

    fn loss(&self, batch: Self::Batch) -> Tensor<1> {
        let logits = self.forward(batch.images);
        self.head.loss(logits, batch.labels)
    }
}
