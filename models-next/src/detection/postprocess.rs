//! From head outputs to detections (MMDetection's `get_bboxes` and `multiclass_nms`): per level
//! the `nms_pre` anchors with the highest class score, decoded and clipped to the image, all
//! levels together mapped back to the original image, then per class the boxes above
//! `score_thr`, non-maximum suppression at `nms.iou_threshold` (burn-vision's), and the
//! `max_per_img` best.

use burn::prelude::*;
use burn_vision::{Nms, NmsOptions};
use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use super::boxes::BBox;
use super::Detection;
use crate::memsave::{Error, Result};

/// `test_cfg.nms`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct NmsConfig {
    /// `"nms"`.
    #[serde(rename = "type")]
    #[default("nms".to_string())]
    pub kind: String,
    /// A box is suppressed by a better one of its class overlapping it more than this.
    #[default(0.5)]
    pub iou_threshold: f32,
}

/// `[model.test_cfg]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct TestCfg {
    /// Candidates kept per level before NMS.
    #[default(1000)]
    pub nms_pre: usize,
    /// Boxes narrower or shorter than this are dropped (0: none).
    pub min_bbox_size: f32,
    /// The least score a detection needs.
    #[default(0.05)]
    pub score_thr: f32,
    /// The suppression.
    pub nms: NmsConfig,
    /// Detections per image.
    #[default(100)]
    pub max_per_img: usize,
}

impl TestCfg {
    /// Checks the values; errors name the field.
    pub fn check(&self) -> Result<()> {
        let bad = |field: &str, message: String| Err(Error::invalid(field, message));
        if self.nms.kind != "nms" {
            return bad(
                "nms.type",
                format!("`{}` is not known: use \"nms\"", self.nms.kind),
            );
        }
        if !(0.0..=1.0).contains(&self.nms.iou_threshold) {
            return bad(
                "nms.iou_threshold",
                format!("must be in [0, 1], got {}", self.nms.iou_threshold),
            );
        }
        if !(0.0..=1.0).contains(&self.score_thr) {
            return bad(
                "score_thr",
                format!("must be in [0, 1], got {}", self.score_thr),
            );
        }
        if self.nms_pre == 0 || self.max_per_img == 0 {
            return bad(
                "nms_pre",
                "nms_pre and max_per_img must be at least 1".to_string(),
            );
        }
        Ok(())
    }
}

/// The indices of the `k` largest `keys`, best first (ties: the lower index first).
pub fn top_k(keys: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by(|&a, &b| keys[b].total_cmp(&keys[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Class-aware NMS over `boxes` with `scores` and `labels`: the kept indices, best first, at
/// most `max` (0: all). Boxes of different classes never suppress each other (each class is
/// shifted out of the others' way, as MMCV's `batched_nms`).
pub fn batched_nms(
    boxes: &[BBox],
    scores: &[f32],
    labels: &[usize],
    iou_threshold: f32,
    max: usize,
) -> Vec<usize> {
    if boxes.is_empty() {
        return Vec::new();
    }
    let extent = boxes
        .iter()
        .flat_map(|b| b.iter().map(|v| v.abs()))
        .fold(0.0f32, f32::max)
        + 1.0;
    let mut shifted = Vec::with_capacity(boxes.len() * 4);
    for (b, &label) in boxes.iter().zip(labels) {
        let offset = label as f32 * 2.0 * extent;
        shifted.extend(b.iter().map(|v| v + offset));
    }
    let device = Device::flex();
    let boxes = Tensor::<2>::from_data(TensorData::new(shifted, [boxes.len(), 4]), &device);
    let scores = Tensor::<1>::from_data(TensorData::new(scores.to_vec(), [scores.len()]), &device);
    let keep = boxes.nms(
        scores,
        NmsOptions {
            iou_threshold,
            score_threshold: f32::NEG_INFINITY,
            max_output_boxes: max,
        },
    );
    keep.into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("NMS returns integer indices")
        .into_iter()
        .map(|i| i as usize)
        .collect()
}

/// One level's candidates of one image: `scores` `[anchors, classes]` (sigmoid), `deltas`
/// `[anchors, 4]`, the level's `anchors`; returns the decoded boxes (clipped to `img_shape`)
/// and score rows of the `nms_pre` best anchors.
pub fn level_candidates(
    cfg: &TestCfg,
    coder: &super::head::BBoxCoderConfig,
    scores: &[f32],
    deltas: &[f32],
    anchors: &[BBox],
    num_classes: usize,
    img_shape: [usize; 2],
) -> Vec<(BBox, Vec<f32>)> {
    let best: Vec<f32> = scores
        .chunks_exact(num_classes)
        .map(|row| row.iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let keep = if best.len() > cfg.nms_pre {
        top_k(&best, cfg.nms_pre)
    } else {
        (0..best.len()).collect()
    };
    let shape = [img_shape[0] as f32, img_shape[1] as f32];
    keep.into_iter()
        .map(|i| {
            let d = &deltas[i * 4..i * 4 + 4];
            let d = [
                d[0] * coder.target_stds[0] + coder.target_means[0],
                d[1] * coder.target_stds[1] + coder.target_means[1],
                d[2] * coder.target_stds[2] + coder.target_means[2],
                d[3] * coder.target_stds[3] + coder.target_means[3],
            ];
            let b = super::coder::decode(&anchors[i], &d, Some(shape));
            (b, scores[i * num_classes..(i + 1) * num_classes].to_vec())
        })
        .collect()
}

/// All levels' candidates of one image -> its detections, in the original image's pixels
/// (boxes divided by the scale factor, un-flipped when the image was flipped).
pub fn detections(
    cfg: &TestCfg,
    candidates: Vec<(BBox, Vec<f32>)>,
    meta: &super::ImageMeta,
) -> Vec<Detection> {
    let [ws, hs] = meta.scale_factor;
    let mut boxes = Vec::new();
    let mut scores = Vec::new();
    let mut labels = Vec::new();
    for (b, row) in candidates {
        let mut b = b;
        if meta.flip {
            let w = meta.img_shape[1] as f32;
            b = [w - b[2], b[1], w - b[0], b[3]];
        }
        let b = [b[0] / ws, b[1] / hs, b[2] / ws, b[3] / hs];
        if cfg.min_bbox_size > 0.0
            && (b[2] - b[0] < cfg.min_bbox_size || b[3] - b[1] < cfg.min_bbox_size)
        {
            continue;
        }
        for (label, &score) in row.iter().enumerate() {
            if score > cfg.score_thr {
                boxes.push(b);
                scores.push(score);
                labels.push(label);
            }
        }
    }
    batched_nms(
        &boxes,
        &scores,
        &labels,
        cfg.nms.iou_threshold,
        cfg.max_per_img,
    )
    .into_iter()
    .map(|i| Detection {
        bbox: boxes[i],
        score: scores[i],
        label: labels[i],
    })
    .collect()
}
