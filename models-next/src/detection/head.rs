//! RetinaHead (Lin et al., 2017): two branches of stacked 3x3 conv + ReLU shared by every
//! pyramid level, one predicting a sigmoid score per anchor and class, the other the box
//! deltas of each anchor.

use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Initializer, PaddingConfig2d};
use burn::prelude::*;
use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use super::anchors::AnchorGeneratorConfig;
use crate::memsave::fp16::Fp16;
use crate::memsave::nn::relu;
use crate::memsave::{Error, Result};
use memsave_macros::{auto_fp16, with_cp};

/// `bbox_coder`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct BBoxCoderConfig {
    /// `"DeltaXYWHBBoxCoder"`.
    #[serde(rename = "type")]
    #[default("DeltaXYWHBBoxCoder".to_string())]
    pub kind: String,
    /// Subtracted from the deltas after encoding.
    #[default([0.0; 4])]
    pub target_means: [f32; 4],
    /// The deltas are divided by these after encoding.
    #[default([1.0; 4])]
    pub target_stds: [f32; 4],
}

/// `loss_cls`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct FocalLossConfig {
    /// `"FocalLoss"`.
    #[serde(rename = "type")]
    #[default("FocalLoss".to_string())]
    pub kind: String,
    /// Sigmoid per class (the only form RetinaNet uses).
    #[default(true)]
    pub use_sigmoid: bool,
    /// The focusing exponent.
    #[default(2.0)]
    pub gamma: f32,
    /// The weight of positives (negatives: `1 - alpha`).
    #[default(0.25)]
    pub alpha: f32,
    /// Multiplies the loss.
    #[default(1.0)]
    pub loss_weight: f32,
}

/// `loss_bbox`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct L1LossConfig {
    /// `"L1Loss"`.
    #[serde(rename = "type")]
    #[default("L1Loss".to_string())]
    pub kind: String,
    /// Multiplies the loss.
    #[default(1.0)]
    pub loss_weight: f32,
}

/// `[model.bbox_head]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct RetinaHeadConfig {
    /// `"RetinaHead"`.
    #[serde(rename = "type")]
    #[default("RetinaHead".to_string())]
    pub kind: String,
    /// Object classes (VOC: 20), without a background class (sigmoid scores).
    #[default(20)]
    pub num_classes: usize,
    /// Channels of each pyramid level.
    #[default(256)]
    pub in_channels: usize,
    /// 3x3 conv + ReLU layers per branch.
    #[default(4)]
    pub stacked_convs: usize,
    /// Their channels.
    #[default(256)]
    pub feat_channels: usize,
    /// The anchors.
    pub anchor_generator: AnchorGeneratorConfig,
    /// The box coder.
    pub bbox_coder: BBoxCoderConfig,
    /// The classification loss.
    pub loss_cls: FocalLossConfig,
    /// The box loss.
    pub loss_bbox: L1LossConfig,
    /// Recompute each branch at each level in backward (a segment per level and branch, which
    /// keeps only the level's input): the head's stacked convs at the largest level are the
    /// detector's biggest activations at the end of the forward. Beyond MMDetection, whose
    /// heads have no `with_cp`.
    pub with_cp: bool,
}

/// A 3x3 conv of `channels`, weights from N(0, 0.01), bias `bias`.
fn conv3x3(channels: [usize; 2], bias: f32, device: &Device) -> Conv2d {
    let mut conv = Conv2dConfig::new(channels, [3, 3])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .with_initializer(Initializer::Normal {
            mean: 0.0,
            std: 0.01,
        })
        .init(device);
    conv.bias = Some(Param::from_tensor(Tensor::full(
        [channels[1]],
        bias,
        device,
    )));
    conv
}

impl RetinaHeadConfig {
    /// Checks the values; errors name the field (`anchor_generator.<field>` for the anchors).
    pub fn check(&self) -> Result<()> {
        let bad = |field: &str, message: String| Err(Error::invalid(field, message));
        if self.kind != "RetinaHead" {
            return bad(
                "type",
                format!("`{}` is not known: use \"RetinaHead\"", self.kind),
            );
        }
        for (field, value) in [
            ("num_classes", self.num_classes),
            ("in_channels", self.in_channels),
            ("feat_channels", self.feat_channels),
        ] {
            if value == 0 {
                return bad(field, "must be at least 1".to_string());
            }
        }
        if self.bbox_coder.kind != "DeltaXYWHBBoxCoder" {
            return bad(
                "bbox_coder.type",
                format!(
                    "`{}` is not known: use \"DeltaXYWHBBoxCoder\"",
                    self.bbox_coder.kind
                ),
            );
        }
        if self.bbox_coder.target_stds.iter().any(|s| !(*s > 0.0)) {
            return bad(
                "bbox_coder.target_stds",
                format!("must be positive, got {:?}", self.bbox_coder.target_stds),
            );
        }
        if self.loss_cls.kind != "FocalLoss" || !self.loss_cls.use_sigmoid {
            return bad(
                "loss_cls",
                "RetinaHead trains with `{ type = \"FocalLoss\", use_sigmoid = true }`".to_string(),
            );
        }
        if !(0.0..=1.0).contains(&self.loss_cls.alpha) || !(self.loss_cls.gamma >= 0.0) {
            return bad(
                "loss_cls",
                format!(
                    "alpha must be in [0, 1] and gamma at least 0, got alpha {} gamma {}",
                    self.loss_cls.alpha, self.loss_cls.gamma
                ),
            );
        }
        if self.loss_bbox.kind != "L1Loss" {
            return bad(
                "loss_bbox.type",
                format!("`{}` is not known: use \"L1Loss\"", self.loss_bbox.kind),
            );
        }
        self.anchor_generator
            .check()
            .map_err(|e| e.within("anchor_generator"))
    }

    /// The head: N(0, 0.01) weights, zero biases, and the classifier's bias at
    /// `-log((1 - 0.01) / 0.01)` so that every score starts at the prior 0.01.
    pub fn init(&self, device: &Device) -> Result<RetinaHead> {
        self.check()?;
        let branch = || {
            (0..self.stacked_convs)
                .map(|i| {
                    let input = if i == 0 {
                        self.in_channels
                    } else {
                        self.feat_channels
                    };
                    conv3x3([input, self.feat_channels], 0.0, device)
                })
                .collect::<Vec<_>>()
        };
        let last = if self.stacked_convs == 0 {
            self.in_channels
        } else {
            self.feat_channels
        };
        let anchors = self.anchor_generator.num_base_anchors();
        let prior = 0.01f32;
        Ok(RetinaHead {
            cls_convs: branch(),
            reg_convs: branch(),
            retina_cls: conv3x3(
                [last, anchors * self.num_classes],
                -((1.0 - prior) / prior).ln(),
                device,
            ),
            retina_reg: conv3x3([last, anchors * 4], 0.0, device),
            num_classes: self.num_classes,
            with_cp: self.with_cp,
            fp16_enabled: Fp16::Off,
        })
    }
}

/// The head.
#[memsave_macros::model]
#[derive(Module, Debug)]
pub struct RetinaHead {
    cls_convs: Vec<Conv2d>,
    reg_convs: Vec<Conv2d>,
    retina_cls: Conv2d,
    retina_reg: Conv2d,
    num_classes: usize,
    with_cp: bool,
    fp16_enabled: Fp16,
}

impl RetinaHead {
    /// Pyramid levels `[N, C, H_l, W_l]` -> per level, class logits `[N, H_l * W_l * A,
    /// classes]` and box deltas `[N, H_l * W_l * A, 4]`, location-major (as the anchors).
    #[auto_fp16]
    pub fn forward(&self, feats: Vec<Tensor<4>>) -> Vec<(Tensor<3>, Tensor<3>)> {
        feats
            .into_iter()
            .map(|x| {
                let cls = self.branch(x.clone(), false);
                let reg = self.branch(x, true);
                let n = cls.dims()[0] as i32;
                let cls = cls
                    .permute([0, 2, 3, 1])
                    .reshape([n, -1, self.num_classes as i32]);
                let reg = reg.permute([0, 2, 3, 1]).reshape([n, -1, 4]);
                (cls, reg)
            })
            .collect()
    }

    /// One level through one branch: the stacked 3x3 conv + ReLU layers and the branch's
    /// predictor (`reg`: the box deltas, else the class logits), `[N, C, H, W]` -> `[N, A * K,
    /// H, W]`; one segment when `with_cp` is on.
    #[with_cp]
    fn branch(&self, x: Tensor<4>, reg: bool) -> Tensor<4> {
        let (convs, predictor) = if reg {
            (&self.reg_convs, &self.retina_reg)
        } else {
            (&self.cls_convs, &self.retina_cls)
        };
        let mut x = x;
        for conv in convs {
            x = relu(conv.forward(x));
        }
        predictor.forward(x)
    }
}
