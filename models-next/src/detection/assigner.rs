//! MMDetection's `MaxIoUAssigner` as RetinaNet configures it: each anchor takes the ground
//! truth it overlaps most if that IoU is at least `pos_iou_thr`, is background below
//! `neg_iou_thr`, and is ignored in between; then each ground truth also takes the anchors it
//! overlaps most (low-quality matches), so that no object goes without an anchor.

use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use super::boxes::{iou, BBox};

/// `train_cfg.assigner`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct MaxIoUAssignerConfig {
    /// `"MaxIoUAssigner"`.
    #[serde(rename = "type")]
    #[default("MaxIoUAssigner".to_string())]
    pub kind: String,
    /// IoU at or above which an anchor is positive.
    #[default(0.5)]
    pub pos_iou_thr: f32,
    /// IoU below which an anchor is negative.
    #[default(0.4)]
    pub neg_iou_thr: f32,
    /// The least IoU a low-quality match needs.
    pub min_pos_iou: f32,
    /// Low-quality matches give a ground truth every anchor that ties for its best IoU.
    #[default(true)]
    pub gt_max_assign_all: bool,
    /// Allow low-quality matches at all.
    #[default(true)]
    pub match_low_quality: bool,
    /// MMDetection's ignore rule for `gt_bboxes_ignore` (-1: off, the only supported value).
    #[default(-1.0)]
    pub ignore_iof_thr: f32,
}

/// What an anchor became.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assignment {
    /// Neither: no loss (between the thresholds, or on padding).
    Ignored,
    /// Background.
    Negative,
    /// Matched to ground truth `index`.
    Positive(usize),
}

impl MaxIoUAssignerConfig {
    /// Checks the values; errors name the field.
    pub fn check(&self) -> crate::memsave::Result<()> {
        let bad =
            |field: &str, message: String| Err(crate::memsave::Error::invalid(field, message));
        if self.kind != "MaxIoUAssigner" {
            return bad(
                "type",
                format!("`{}` is not known: use \"MaxIoUAssigner\"", self.kind),
            );
        }
        for (field, value) in [
            ("pos_iou_thr", self.pos_iou_thr),
            ("neg_iou_thr", self.neg_iou_thr),
            ("min_pos_iou", self.min_pos_iou),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return bad(field, format!("must be in [0, 1], got {value}"));
            }
        }
        if self.neg_iou_thr > self.pos_iou_thr {
            return bad(
                "neg_iou_thr",
                format!(
                    "{} is above pos_iou_thr ({}): an anchor would be both",
                    self.neg_iou_thr, self.pos_iou_thr
                ),
            );
        }
        if self.ignore_iof_thr >= 0.0 {
            return bad(
                "ignore_iof_thr",
                "ignored ground truth is not supported: leave it at -1 (difficult VOC objects \
                 are left out of training)"
                    .to_string(),
            );
        }
        Ok(())
    }

    /// Assigns `anchors` (those with `valid` false are ignored and match nothing) to `gts`.
    pub fn assign(&self, anchors: &[BBox], valid: &[bool], gts: &[BBox]) -> Vec<Assignment> {
        let mut assigned = vec![Assignment::Ignored; anchors.len()];
        if gts.is_empty() {
            for (a, &v) in assigned.iter_mut().zip(valid) {
                if v {
                    *a = Assignment::Negative;
                }
            }
            return assigned;
        }
        // Per anchor, its best ground truth; per ground truth, its best IoU.
        let mut gt_best = vec![f32::NEG_INFINITY; gts.len()];
        let mut overlaps = vec![0.0f32; anchors.len() * gts.len()];
        for (i, anchor) in anchors.iter().enumerate() {
            if !valid[i] {
                continue;
            }
            let row = &mut overlaps[i * gts.len()..(i + 1) * gts.len()];
            let (mut best, mut best_gt) = (f32::NEG_INFINITY, 0);
            for (j, gt) in gts.iter().enumerate() {
                let o = iou(anchor, gt);
                row[j] = o;
                if o > best {
                    (best, best_gt) = (o, j);
                }
                gt_best[j] = gt_best[j].max(o);
            }
            assigned[i] = if best >= self.pos_iou_thr {
                Assignment::Positive(best_gt)
            } else if best >= 0.0 && best < self.neg_iou_thr {
                Assignment::Negative
            } else {
                Assignment::Ignored
            };
        }
        if self.match_low_quality {
            for (j, &best) in gt_best.iter().enumerate() {
                // A ground truth that overlaps no anchor at all gets none (MMDetection would
                // hand it every anchor at IoU 0 when `min_pos_iou` is 0).
                if !(best > 0.0) || best < self.min_pos_iou {
                    continue;
                }
                if self.gt_max_assign_all {
                    for i in 0..anchors.len() {
                        if valid[i] && overlaps[i * gts.len() + j] == best {
                            assigned[i] = Assignment::Positive(j);
                        }
                    }
                } else if let Some(i) =
                    (0..anchors.len()).find(|&i| valid[i] && overlaps[i * gts.len() + j] == best)
                {
                    assigned[i] = Assignment::Positive(j);
                }
            }
        }
        assigned
    }
}
