//! The `model` and `data` sections of a training configuration (Burn 0.22, the files Burn 0.21's
//! memsave reads): each model's own `[model]` section (the registry picks it by `model.type`),
//! and the data sets.

use serde::Deserialize;

use crate::data::synthetic::SyntheticClassificationConfig;
use crate::detection::fpn::FpnConfig;
use crate::detection::head::RetinaHeadConfig;
use crate::detection::postprocess::TestCfg;
use crate::detection::retinanet::{RetinaNetConfig, TrainCfg};
use crate::memsave::{Error, Result};
use crate::resnet::ResNetConfig;

pub use crate::data::voc::loader::DetectionDataSection;

/// The models, by `model.type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum ModelType {
    /// ResNet + global pooling + linear.
    ImageClassifier,
    /// ResNet + FPN + RetinaHead.
    RetinaNet,
}

/// Any `[model]` section, read for its `type` only: the model's own section reads the rest
/// once the registry knows which it is.
#[derive(Clone, Debug, Deserialize)]
pub struct ModelKind {
    /// `model.type`.
    #[serde(rename = "type")]
    pub kind: ModelType,
    #[serde(flatten)]
    _rest: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

/// `[model]` of an `ImageClassifier`: a ResNet, global pooling and a linear head.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifierSection {
    /// `ImageClassifier`.
    #[serde(rename = "type")]
    pub kind: ModelType,
    /// Its classes.
    #[serde(default)]
    pub num_classes: Option<usize>,
    /// `[model.backbone]` (MMDetection's `backbone = dict(type='ResNet', ...)`).
    #[serde(default)]
    pub backbone: ResNetConfig,
}

impl ClassifierSection {
    /// Its classes; an error naming `model.num_classes` when they are not given.
    pub fn classes(&self) -> Result<usize> {
        self.num_classes.ok_or_else(|| {
            Error::invalid(
                "model.num_classes",
                "an ImageClassifier needs its number of classes",
            )
        })
    }
}

/// `[model]` of a `RetinaNet`: MMDetection's `model = dict(type='RetinaNet', backbone=...,
/// neck=..., bbox_head=..., train_cfg=..., test_cfg=...)`; each part absent is MMDetection's
/// default. Its classes are `bbox_head.num_classes`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetinaNetSection {
    /// `RetinaNet`.
    #[serde(rename = "type")]
    pub kind: ModelType,
    /// Read only to say where a detector's classes go (`bbox_head.num_classes`).
    #[serde(default)]
    num_classes: Option<usize>,
    /// `[model.backbone]`.
    #[serde(default)]
    pub backbone: ResNetConfig,
    /// `[model.neck]`: the FPN.
    #[serde(default)]
    pub neck: FpnConfig,
    /// `[model.bbox_head]`: the head.
    #[serde(default)]
    pub bbox_head: RetinaHeadConfig,
    /// `[model.train_cfg]`: the assigner.
    #[serde(default)]
    pub train_cfg: TrainCfg,
    /// `[model.test_cfg]`: inference settings.
    #[serde(default)]
    pub test_cfg: TestCfg,
}

impl RetinaNetSection {
    /// The detector, checked; errors name the key (`model.neck.in_channels`).
    pub fn retinanet(&self) -> Result<RetinaNetConfig> {
        if self.num_classes.is_some() {
            return Err(Error::invalid(
                "model.num_classes",
                "a RetinaNet's classes are `model.bbox_head.num_classes` (as MMDetection's)",
            ));
        }
        let config = RetinaNetConfig {
            backbone: self.backbone.clone(),
            neck: self.neck.clone(),
            bbox_head: self.bbox_head.clone(),
            train_cfg: self.train_cfg.clone(),
            test_cfg: self.test_cfg.clone(),
        };
        config.check().map_err(|e| e.within("model"))?;
        Ok(config)
    }
}

/// `[data]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum DataSection {
    /// Made on the fly; see [`crate::data::synthetic::SyntheticClassification`].
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
