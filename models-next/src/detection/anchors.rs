//! Anchors: MMDetection's `AnchorGenerator` as RetinaNet configures it (octave base scale 4, 3
//! scales per octave, ratios 0.5/1/2, strides 8 to 128, base size = stride, centre offset 0).

use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use super::boxes::BBox;

/// `anchor_generator` of a RetinaHead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct AnchorGeneratorConfig {
    /// `"AnchorGenerator"`.
    #[serde(rename = "type")]
    #[default("AnchorGenerator".to_string())]
    pub kind: String,
    /// The smallest anchor of a level is `octave_base_scale * stride` wide.
    #[default(4.0)]
    pub octave_base_scale: f32,
    /// Scales per octave: `octave_base_scale * 2^(i / scales_per_octave)`.
    #[default(3)]
    pub scales_per_octave: usize,
    /// Height / width ratios.
    #[default(vec![0.5, 1.0, 2.0])]
    pub ratios: Vec<f32>,
    /// The stride of each level (P3..P7: 8, 16, 32, 64, 128).
    #[default(vec![8, 16, 32, 64, 128])]
    pub strides: Vec<usize>,
    /// Where a location's anchors are centred, as a fraction of the stride (MMDetection: 0,
    /// the top-left corner of the cell).
    pub center_offset: f32,
}

impl AnchorGeneratorConfig {
    /// Anchors per location.
    pub fn num_base_anchors(&self) -> usize {
        self.ratios.len() * self.scales_per_octave
    }

    /// Checks the values; errors name the field.
    pub fn check(&self) -> crate::memsave::Result<()> {
        let bad =
            |field: &str, message: String| Err(crate::memsave::Error::invalid(field, message));
        if self.kind != "AnchorGenerator" {
            return bad(
                "type",
                format!("`{}` is not known: use \"AnchorGenerator\"", self.kind),
            );
        }
        if !(self.octave_base_scale > 0.0) {
            return bad(
                "octave_base_scale",
                format!("must be positive, got {}", self.octave_base_scale),
            );
        }
        if self.scales_per_octave == 0 {
            return bad("scales_per_octave", "must be at least 1".to_string());
        }
        if self.ratios.is_empty() || self.ratios.iter().any(|r| !(*r > 0.0)) {
            return bad(
                "ratios",
                format!("must be positive numbers, got {:?}", self.ratios),
            );
        }
        if self.strides.is_empty() || self.strides.contains(&0) {
            return bad(
                "strides",
                format!("must be positive, got {:?}", self.strides),
            );
        }
        Ok(())
    }

    /// The anchors of one location of `level`, centred at the origin shifted by the centre
    /// offset: ratio-major, then scale (MMDetection's `gen_base_anchors`).
    pub fn base_anchors(&self, level: usize) -> Vec<BBox> {
        let base = self.strides[level] as f32;
        let centre = self.center_offset * base;
        let scales: Vec<f32> = (0..self.scales_per_octave)
            .map(|i| self.octave_base_scale * 2f32.powf(i as f32 / self.scales_per_octave as f32))
            .collect();
        let mut anchors = Vec::with_capacity(self.num_base_anchors());
        for &ratio in &self.ratios {
            let h_ratio = ratio.sqrt();
            let w_ratio = 1.0 / h_ratio;
            for &scale in &scales {
                let (w, h) = (base * w_ratio * scale, base * h_ratio * scale);
                anchors.push([
                    centre - 0.5 * w,
                    centre - 0.5 * h,
                    centre + 0.5 * w,
                    centre + 0.5 * h,
                ]);
            }
        }
        anchors
    }

    /// Every anchor of `level` on a `[height, width]` feature map: location-major (row, then
    /// column), the location's base anchors within (the order of the head's flattened output).
    pub fn grid_anchors(&self, level: usize, [height, width]: [usize; 2]) -> Vec<BBox> {
        let stride = self.strides[level] as f32;
        let base = self.base_anchors(level);
        let mut anchors = Vec::with_capacity(height * width * base.len());
        for y in 0..height {
            for x in 0..width {
                let (sx, sy) = (x as f32 * stride, y as f32 * stride);
                anchors.extend(
                    base.iter()
                        .map(|a| [a[0] + sx, a[1] + sy, a[2] + sx, a[3] + sy]),
                );
            }
        }
        anchors
    }

    /// Which anchors of `level` lie on the image rather than on the batch's padding: an
    /// image padded to `[pad_h, pad_w]` covers `ceil(pad / stride)` locations each way
    /// (MMDetection's `valid_flags`).
    pub fn valid_flags(
        &self,
        level: usize,
        [height, width]: [usize; 2],
        [pad_h, pad_w]: [usize; 2],
    ) -> Vec<bool> {
        let stride = self.strides[level];
        let (valid_h, valid_w) = (
            pad_h.div_ceil(stride).min(height),
            pad_w.div_ceil(stride).min(width),
        );
        let per_location = self.num_base_anchors();
        let mut flags = Vec::with_capacity(height * width * per_location);
        for y in 0..height {
            for x in 0..width {
                let valid = y < valid_h && x < valid_w;
                flags.extend(std::iter::repeat_n(valid, per_location));
            }
        }
        flags
    }
}
