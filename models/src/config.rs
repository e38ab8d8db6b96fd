//! The `model` and `data` sections of a training configuration.

use serde::Deserialize;

use crate::data::SyntheticClassificationConfig;
use crate::resnet::ResNetConfig;

/// `[model]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// `ImageClassifier` (RetinaNet to come).
    #[serde(rename = "type")]
    pub kind: ModelType,
    /// Classes to tell apart.
    pub num_classes: usize,
    /// `[model.backbone]`.
    pub backbone: BackboneSection,
}

/// The models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum ModelType {
    /// ResNet + global pooling + linear.
    ImageClassifier,
}

/// `[model.backbone]` (MMDetection's `backbone = dict(type='ResNet', depth=50, with_cp=True)`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackboneSection {
    /// `ResNet`.
    #[serde(rename = "type", default = "resnet")]
    pub kind: BackboneType,
    /// 18, 34, 50, 101 or 152.
    pub depth: usize,
    /// Checkpoint every block.
    #[serde(default)]
    pub with_cp: bool,
    /// Channels of the input images.
    #[serde(default = "three")]
    pub in_channels: usize,
}

impl BackboneSection {
    /// The ResNet it describes.
    pub fn resnet(&self) -> ResNetConfig {
        ResNetConfig::new(self.depth)
            .with_with_cp(self.with_cp)
            .with_in_channels(self.in_channels)
    }
}

fn resnet() -> BackboneType {
    BackboneType::ResNet
}

fn three() -> usize {
    3
}

/// The backbones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum BackboneType {
    /// He et al.'s residual network.
    ResNet,
}

/// `[data]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum DataSection {
    /// Made on the fly; see [`crate::data::SyntheticClassification`].
    SyntheticClassification(SyntheticClassificationConfig),
}
