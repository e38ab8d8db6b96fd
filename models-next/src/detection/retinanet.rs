//! The detector: ResNet backbone, FPN neck and RetinaHead; training targets and losses, and
//! inference.

use burn::module::Module;
use burn::prelude::*;
use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use super::anchors::AnchorGeneratorConfig;
use super::assigner::{Assignment, MaxIoUAssignerConfig};
use super::boxes::BBox;
use super::fpn::{Fpn, FpnConfig};
use super::head::{RetinaHead, RetinaHeadConfig};
use super::losses::{l1_loss, sigmoid_focal_loss};
use super::postprocess::{detections, level_candidates, TestCfg};
use super::{Detection, DetectionBatch, ImageMeta};
use crate::memsave::fp16::Fp16;
use crate::memsave::memory;
use crate::memsave::planner::WithCp;
use crate::memsave::train::TrainModel;
use crate::memsave::{Error, Result};
use crate::resnet::{ResNet, ResNetConfig};
use memsave_macros::{auto_fp16, force_fp32};

/// `[model.train_cfg]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct TrainCfg {
    /// Which anchors learn what.
    pub assigner: MaxIoUAssignerConfig,
    /// Anchors may stick out of the image by this much (-1: any amount; the only supported
    /// value, as RetinaNet's).
    #[default(-1)]
    pub allowed_border: i64,
    /// Weight of positives (-1: 1).
    #[default(-1.0)]
    pub pos_weight: f32,
    /// MMDetection's debug switch (no effect).
    pub debug: bool,
}

/// Everything that makes a RetinaNet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RetinaNetConfig {
    /// The backbone.
    pub backbone: ResNetConfig,
    /// The neck.
    pub neck: FpnConfig,
    /// The head.
    pub bbox_head: RetinaHeadConfig,
    /// Training settings.
    pub train_cfg: TrainCfg,
    /// Inference settings.
    pub test_cfg: TestCfg,
}

impl RetinaNetConfig {
    /// MMDetection's `retinanet_r50_fpn` for `num_classes` classes: a ResNet-50 (frozen stem
    /// and stage 1, `norm_eval`), FPN P3-P7 of 256 channels, the head of 4 convs per branch.
    pub fn r50_fpn(num_classes: usize) -> Self {
        RetinaNetConfig {
            backbone: ResNetConfig {
                frozen_stages: 1,
                norm_eval: true,
                ..ResNetConfig::default()
            },
            neck: FpnConfig::default(),
            bbox_head: RetinaHeadConfig {
                num_classes,
                ..RetinaHeadConfig::default()
            },
            train_cfg: TrainCfg::default(),
            test_cfg: TestCfg::default(),
        }
    }

    /// The segments to checkpoint, as one setting for the whole model (applied once it is
    /// built): the backbone's `with_cp`, and where that is a list of paths, `neck` and
    /// `bbox_head` added when their own `with_cp` is on. (`true` and `false` need nothing more:
    /// each part's flag is set as it is built.)
    pub fn with_cp(&self) -> WithCp {
        match &self.backbone.with_cp {
            WithCp::Paths(paths) => {
                let mut paths = paths.clone();
                for (on, path) in [
                    (self.neck.with_cp, "neck"),
                    (self.bbox_head.with_cp, "bbox_head"),
                ] {
                    if on && !paths.iter().any(|p| p == path) {
                        paths.push(path.to_string());
                    }
                }
                WithCp::Paths(paths)
            }
            other => other.clone(),
        }
    }

    /// Checks that the pieces fit together; errors name the field.
    pub fn check(&self) -> Result<()> {
        self.neck.check().map_err(|e| e.within("neck"))?;
        self.bbox_head.check().map_err(|e| e.within("bbox_head"))?;
        if self.backbone.with_cp.is_budgeted() {
            for (on, key) in [
                (self.neck.with_cp, "neck.with_cp"),
                (self.bbox_head.with_cp, "bbox_head.with_cp"),
            ] {
                if on {
                    return Err(Error::invalid(
                        key,
                        format!(
                            "with `backbone.with_cp = {}` the planner picks the neck's and the \
                             head's segments too: remove this key, or pin the segments by path \
                             in `backbone.with_cp` (`memsave plan` prints them)",
                            if self.backbone.with_cp == WithCp::Auto {
                                "\"auto\""
                            } else {
                                "\"dynamic\""
                            }
                        ),
                    ));
                }
            }
        }
        self.train_cfg
            .assigner
            .check()
            .map_err(|e| e.within("train_cfg.assigner"))?;
        self.test_cfg.check().map_err(|e| e.within("test_cfg"))?;
        let channels = self
            .backbone
            .stage_channels()
            .map_err(|e| e.within("backbone"))?;
        let given: Vec<usize> = self
            .backbone
            .out_indices
            .iter()
            .map(|&i| channels[i])
            .collect();
        if given != self.neck.in_channels {
            return Err(Error::invalid(
                "neck.in_channels",
                format!(
                    "{:?} does not match the backbone's outputs {given:?} (out_indices {:?})",
                    self.neck.in_channels, self.backbone.out_indices
                ),
            ));
        }
        if self.bbox_head.in_channels != self.neck.out_channels {
            return Err(Error::invalid(
                "bbox_head.in_channels",
                format!(
                    "{} does not match the neck's out_channels {}",
                    self.bbox_head.in_channels, self.neck.out_channels
                ),
            ));
        }
        let strides = &self.bbox_head.anchor_generator.strides;
        if strides.len() != self.neck.num_outs {
            return Err(Error::invalid(
                "bbox_head.anchor_generator.strides",
                format!(
                    "{} strides for the neck's {} levels",
                    strides.len(),
                    self.neck.num_outs
                ),
            ));
        }
        if self.train_cfg.allowed_border != -1 {
            return Err(Error::invalid(
                "train_cfg.allowed_border",
                "only -1 is supported (anchors on the padding are ignored, any other may stick out)",
            ));
        }
        Ok(())
    }

    /// The detector with fresh (or `init_cfg`) backbone weights.
    pub fn init(&self, device: &Device) -> Result<RetinaNet> {
        self.check()?;
        Ok(RetinaNet {
            backbone: self
                .backbone
                .init(device)
                .map_err(|e| e.within("backbone"))?,
            neck: self.neck.init(device).map_err(|e| e.within("neck"))?,
            bbox_head: self
                .bbox_head
                .init(device)
                .map_err(|e| e.within("bbox_head"))?,
            settings: Settings {
                anchors: self.bbox_head.anchor_generator.clone(),
                head: self.bbox_head.clone(),
                train_cfg: self.train_cfg.clone(),
                test_cfg: self.test_cfg.clone(),
            },
            fp16_enabled: Fp16::Off,
        })
    }
}

/// The settings a detector keeps beside its weights.
#[derive(Clone, Debug)]
pub struct Settings {
    anchors: AnchorGeneratorConfig,
    head: RetinaHeadConfig,
    train_cfg: TrainCfg,
    test_cfg: TestCfg,
}

/// RetinaNet.
#[memsave_macros::model]
#[derive(Module, Debug)]
pub struct RetinaNet {
    /// `set_with_cp` reaches the backbone's blocks, the neck (one segment) and the head (a
    /// segment per level and branch).
    #[with_cp]
    backbone: ResNet,
    #[with_cp]
    neck: Fpn,
    #[with_cp]
    bbox_head: RetinaHead,
    #[module(skip)]
    settings: Settings,
    fp16_enabled: Fp16,
}

/// What the losses compare the head's outputs with, for a whole batch.
#[derive(Clone, Debug)]
pub struct Targets {
    /// One-hot classes of the positives `[N, A, classes]`.
    pub labels: Tensor<3>,
    /// 1 for positives and negatives, 0 for ignored anchors `[N, A, 1]`.
    pub label_weights: Tensor<3>,
    /// Encoded boxes of the positives `[N, A, 4]`.
    pub bbox_targets: Tensor<3>,
    /// 1 for positives `[N, A, 1]`.
    pub bbox_weights: Tensor<3>,
    /// What both losses are divided by: the positives, at least 1 per image.
    pub avg_factor: f32,
    /// Positives per image.
    pub num_pos: Vec<usize>,
}

/// The targets of one image on host: one-hot labels, label weights, box targets, box weights
/// and the number of positives.
pub type ImageTargets = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, usize);

impl RetinaNet {
    /// The anchors of every level for these feature map sizes, concatenated.
    pub fn anchors(&self, sizes: &[[usize; 2]]) -> Vec<BBox> {
        sizes
            .iter()
            .enumerate()
            .flat_map(|(level, &size)| self.settings.anchors.grid_anchors(level, size))
            .collect()
    }

    /// Classes it tells apart.
    pub fn num_classes(&self) -> usize {
        self.settings.head.num_classes
    }

    /// The targets of one image: anchors on its padding ignored, then MMDetection's
    /// assignment against `gts` / `labels`.
    pub fn image_targets(
        &self,
        sizes: &[[usize; 2]],
        anchors: &[BBox],
        meta: &ImageMeta,
        gts: &[BBox],
        labels: &[usize],
    ) -> ImageTargets {
        let valid: Vec<bool> = sizes
            .iter()
            .enumerate()
            .flat_map(|(level, &size)| {
                self.settings
                    .anchors
                    .valid_flags(level, size, meta.pad_shape)
            })
            .collect();
        let assigned = self
            .settings
            .train_cfg
            .assigner
            .assign(anchors, &valid, gts);
        let classes = self.num_classes();
        let coder = &self.settings.head.bbox_coder;
        let n = anchors.len();
        let (mut onehot, mut label_w) = (vec![0.0f32; n * classes], vec![0.0f32; n]);
        let (mut bbox_t, mut bbox_w) = (vec![0.0f32; n * 4], vec![0.0f32; n]);
        let mut num_pos = 0;
        let pos_weight = if self.settings.train_cfg.pos_weight > 0.0 {
            self.settings.train_cfg.pos_weight
        } else {
            1.0
        };
        for (i, a) in assigned.iter().enumerate() {
            match *a {
                Assignment::Ignored => {}
                Assignment::Negative => label_w[i] = 1.0,
                Assignment::Positive(j) => {
                    num_pos += 1;
                    label_w[i] = pos_weight;
                    onehot[i * classes + labels[j]] = 1.0;
                    let d = super::coder::encode(&anchors[i], &gts[j]);
                    for k in 0..4 {
                        bbox_t[i * 4 + k] = (d[k] - coder.target_means[k]) / coder.target_stds[k];
                    }
                    bbox_w[i] = 1.0;
                }
            }
        }
        (onehot, label_w, bbox_t, bbox_w, num_pos)
    }

    /// The targets of a batch whose head outputs came from feature maps of `sizes`.
    pub fn targets(
        &self,
        sizes: &[[usize; 2]],
        metas: &[ImageMeta],
        gt_bboxes: &[Vec<BBox>],
        gt_labels: &[Vec<usize>],
        device: &Device,
    ) -> Targets {
        let anchors = self.anchors(sizes);
        let (n, a, c) = (metas.len(), anchors.len(), self.num_classes());
        let (mut onehot, mut label_w, mut bbox_t, mut bbox_w) = (
            Vec::with_capacity(n * a * c),
            Vec::with_capacity(n * a),
            Vec::with_capacity(n * a * 4),
            Vec::with_capacity(n * a),
        );
        let mut num_pos = Vec::with_capacity(n);
        for ((meta, gts), labels) in metas.iter().zip(gt_bboxes).zip(gt_labels) {
            let (o, lw, bt, bw, pos) = self.image_targets(sizes, &anchors, meta, gts, labels);
            onehot.extend(o);
            label_w.extend(lw);
            bbox_t.extend(bt);
            bbox_w.extend(bw);
            num_pos.push(pos);
        }
        let tensor = |values: Vec<f32>, last: usize| {
            Tensor::<3>::from_data(TensorData::new(values, [n, a, last]), device)
        };
        Targets {
            labels: tensor(onehot, c),
            label_weights: tensor(label_w, 1),
            bbox_targets: tensor(bbox_t, 4),
            bbox_weights: tensor(bbox_w, 1),
            avg_factor: num_pos.iter().map(|&p| p.max(1)).sum::<usize>() as f32,
            num_pos,
        }
    }
}

impl RetinaNet {
    /// Images `[N, 3, H, W]` -> the pyramid levels (P3..P7).
    #[auto_fp16(apply_to = (images))]
    pub fn extract_feat(&self, images: Tensor<4>) -> Vec<Tensor<4>> {
        let feats = memory::scope("backbone", || self.backbone.forward(images));
        memory::scope("neck", || self.neck.forward(feats))
    }

    /// Images -> per level, class logits `[N, anchors_l, classes]` and box deltas
    /// `[N, anchors_l, 4]`, and the levels' feature map sizes.
    pub fn forward(&self, images: Tensor<4>) -> (Vec<(Tensor<3>, Tensor<3>)>, Vec<[usize; 2]>) {
        let feats = self.extract_feat(images);
        let sizes = feats.iter().map(|f| [f.dims()[2], f.dims()[3]]).collect();
        (
            memory::scope("bbox_head", || self.bbox_head.forward(feats)),
            sizes,
        )
    }

    /// The focal loss and the L1 box loss of a batch, each divided by its positives.
    pub fn losses(&self, batch: DetectionBatch) -> (Tensor<1>, Tensor<1>) {
        let device = batch.images.device();
        let (outs, sizes) = self.forward(batch.images);
        let targets = self.targets(
            &sizes,
            &batch.metas,
            &batch.gt_bboxes,
            &batch.gt_labels,
            &device,
        );
        memory::scope("loss", || {
            let (cls, reg): (Vec<_>, Vec<_>) = outs.into_iter().unzip();
            self.head_loss(Tensor::cat(cls, 1), Tensor::cat(reg, 1), targets)
        })
    }

    /// The losses of the concatenated head outputs, in fp32.
    #[force_fp32(args = (cls, reg))]
    pub fn head_loss(
        &self,
        cls: Tensor<3>,
        reg: Tensor<3>,
        targets: Targets,
    ) -> (Tensor<1>, Tensor<1>) {
        let head = &self.settings.head;
        let loss_cls = sigmoid_focal_loss(
            cls,
            targets.labels,
            targets.label_weights,
            head.loss_cls.gamma,
            head.loss_cls.alpha,
        )
        .div_scalar(targets.avg_factor)
        .mul_scalar(head.loss_cls.loss_weight);
        let loss_bbox = l1_loss(reg, targets.bbox_targets, targets.bbox_weights)
            .div_scalar(targets.avg_factor)
            .mul_scalar(head.loss_bbox.loss_weight);
        (loss_cls, loss_bbox)
    }

    /// Detections per image, in the original images' pixels.
    pub fn predict(&self, images: Tensor<4>, metas: &[ImageMeta]) -> Vec<Vec<Detection>> {
        let (outs, sizes) = self.forward(images);
        let classes = self.num_classes();
        let host = |t: Tensor<3>| -> Vec<f32> {
            t.into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("float tensor")
        };
        let levels: Vec<(Vec<f32>, Vec<f32>, usize)> = outs
            .into_iter()
            .map(|(cls, reg)| {
                let per_image = cls.dims()[1];
                let scores = burn::tensor::activation::sigmoid(cls.float_cast_f32());
                (host(scores), host(reg.float_cast_f32()), per_image)
            })
            .collect();
        metas
            .iter()
            .enumerate()
            .map(|(i, meta)| {
                let mut candidates = Vec::new();
                for (level, (scores, deltas, per_image)) in levels.iter().enumerate() {
                    let anchors = self.settings.anchors.grid_anchors(level, sizes[level]);
                    let scores = &scores[i * per_image * classes..(i + 1) * per_image * classes];
                    let deltas = &deltas[i * per_image * 4..(i + 1) * per_image * 4];
                    candidates.extend(level_candidates(
                        &self.settings.test_cfg,
                        &self.settings.head.bbox_coder,
                        scores,
                        deltas,
                        &anchors,
                        classes,
                        meta.img_shape,
                    ));
                }
                detections(&self.settings.test_cfg, candidates, meta)
            })
            .collect()
    }
}

trait CastF32 {
    fn float_cast_f32(self) -> Self;
}

impl CastF32 for Tensor<3> {
    fn float_cast_f32(self) -> Self {
        self.cast(burn::tensor::DType::F32)
    }
}

impl TrainModel for RetinaNet {
    type Batch = DetectionBatch;

    fn loss(&self, batch: Self::Batch) -> Tensor<1> {
        self.loss_with_parts(batch).0
    }

    fn loss_with_parts(&self, batch: Self::Batch) -> (Tensor<1>, Vec<(&'static str, Tensor<1>)>) {
        let (cls, bbox) = self.losses(batch);
        let parts = vec![
            ("loss_cls", cls.clone().detach()),
            ("loss_bbox", bbox.clone().detach()),
        ];
        (cls + bbox, parts)
    }
}
