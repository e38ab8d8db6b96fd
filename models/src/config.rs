//! The `model` and `data` sections of a training configuration.

use serde::Deserialize;

use crate::data::SyntheticClassificationConfig;
use crate::resnet::ResNetConfig;

/// `[model]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// `ImageClassifier`.
    #[serde(rename = "type")]
    pub kind: ModelType,
    /// Classes to tell apart.
    pub num_classes: usize,
    /// `[model.backbone]` (MMDetection's `backbone = dict(type='ResNet', ...)`).
    pub backbone: ResNetConfig,
}

/// The models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum ModelType {
    /// ResNet + global pooling + linear.
    ImageClassifier,
}

/// `[data]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum DataSection {
    /// Made on the fly; see [`crate::data::SyntheticClassification`].
    SyntheticClassification(SyntheticClassificationConfig),
}
