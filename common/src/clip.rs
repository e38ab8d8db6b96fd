//! Clipping by the global norm of the gradients, as configured: its values checked (the
//! runtimes compute the norm and scale the gradients).

use serde::Deserialize;

use crate::error::{Error, Result};

/// Gradient clipping by the global norm over all parameters (PyTorch's `clip_grad_norm_`, as
/// MMCV's `grad_clip = dict(max_norm=35, norm_type=2)`); Burn's own clipping is per tensor.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(try_from = "GradClipFields")]
pub struct GradClip {
    /// The largest global norm allowed.
    pub max_norm: f64,
    /// The norm's `p` (2 by default; `f64::INFINITY` for the largest magnitude).
    pub norm_type: f64,
}

/// [`GradClip`] as written, before [`GradClip::new`] checks it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GradClipFields {
    max_norm: f64,
    #[serde(default = "GradClip::default_norm_type")]
    norm_type: f64,
}

impl TryFrom<GradClipFields> for GradClip {
    type Error = Error;

    fn try_from(fields: GradClipFields) -> Result<Self> {
        GradClip::new(fields.max_norm, fields.norm_type)
    }
}

impl GradClip {
    fn default_norm_type() -> f64 {
        2.0
    }

    /// Checks the values: a positive `max_norm`, a `norm_type` of at least 1 (or infinite).
    pub fn new(max_norm: f64, norm_type: f64) -> Result<Self> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(Error::invalid(
                "max_norm",
                format!("must be a positive number, got {max_norm}"),
            ));
        }
        if norm_type.is_nan() || norm_type < 1.0 {
            return Err(Error::invalid(
                "norm_type",
                format!("must be at least 1 (or inf), got {norm_type}"),
            ));
        }
        Ok(GradClip {
            max_norm,
            norm_type,
        })
    }
}
