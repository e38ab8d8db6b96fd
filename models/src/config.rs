//! The `model` and `data` sections of a training configuration.

use serde::Deserialize;

use crate::data::SyntheticClassificationConfig;
use crate::detection::fpn::FpnConfig;
use crate::detection::head::RetinaHeadConfig;
use crate::detection::postprocess::TestCfg;
use crate::detection::retinanet::{RetinaNetConfig, TrainCfg};
use crate::memsave::{Error, Result};
use crate::resnet::ResNetConfig;

pub use crate::data::voc::loader::DetectionDataSection;

/// `[model]`: MMDetection's `model = dict(type=..., backbone=..., neck=..., bbox_head=...,
/// train_cfg=..., test_cfg=...)`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// `ImageClassifier` or `RetinaNet`.
    #[serde(rename = "type")]
    pub kind: ModelType,
    /// Classes of a classifier (a detector's are `bbox_head.num_classes`).
    #[serde(default)]
    pub num_classes: Option<usize>,
    /// `[model.backbone]` (MMDetection's `backbone = dict(type='ResNet', ...)`).
    #[serde(default)]
    pub backbone: ResNetConfig,
    /// `[model.neck]`: a detector's FPN.
    #[serde(default)]
    pub neck: Option<FpnConfig>,
    /// `[model.bbox_head]`: a detector's head.
    #[serde(default)]
    pub bbox_head: Option<RetinaHeadConfig>,
    /// `[model.train_cfg]`: a detector's assigner.
    #[serde(default)]
    pub train_cfg: Option<TrainCfg>,
    /// `[model.test_cfg]`: a detector's inference settings.
    #[serde(default)]
    pub test_cfg: Option<TestCfg>,
}

/// The models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum ModelType {
    /// ResNet + global pooling + linear.
    ImageClassifier,
    /// ResNet + FPN + RetinaHead.
    RetinaNet,
}

impl ModelSection {
    /// The classes of an `ImageClassifier`; its detector-only sections are an error.
    pub fn classifier_classes(&self) -> Result<usize> {
        for (given, field) in [
            (self.neck.is_some(), "model.neck"),
            (self.bbox_head.is_some(), "model.bbox_head"),
            (self.train_cfg.is_some(), "model.train_cfg"),
            (self.test_cfg.is_some(), "model.test_cfg"),
        ] {
            if given {
                return Err(Error::invalid(
                    field,
                    "belongs to a detector: an ImageClassifier has none",
                ));
            }
        }
        self.num_classes.ok_or_else(|| {
            Error::invalid(
                "model.num_classes",
                "an ImageClassifier needs its number of classes",
            )
        })
    }

    /// The detector of a `RetinaNet` section: each part given, or MMDetection's default.
    pub fn retinanet(&self) -> Result<RetinaNetConfig> {
        if self.num_classes.is_some() {
            return Err(Error::invalid(
                "model.num_classes",
                "a RetinaNet's classes are `model.bbox_head.num_classes` (as MMDetection's)",
            ));
        }
        let config = RetinaNetConfig {
            backbone: self.backbone.clone(),
            neck: self.neck.clone().unwrap_or_default(),
            bbox_head: self.bbox_head.clone().unwrap_or_default(),
            train_cfg: self.train_cfg.clone().unwrap_or_default(),
            test_cfg: self.test_cfg.clone().unwrap_or_default(),
        };
        config.check()?;
        Ok(config)
    }
}

/// `[data]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum DataSection {
    /// Made on the fly; see [`crate::data::SyntheticClassification`].
    SyntheticClassification(SyntheticClassificationConfig),
}

/// Any `[data]` section, unread: for reading the model's type before the data's schema is
/// known.
#[derive(Clone, Copy, Debug, Default)]
pub struct AnyData;

impl<'de> Deserialize<'de> for AnyData {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(deserializer).map(|_| AnyData)
    }
}
