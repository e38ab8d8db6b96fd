//! Loss scaling for mixed-precision training (MMCV's `LossScaler`).
//!
//! The loss is multiplied by `loss_scale()` before backward, so that small gradients do not
//! underflow in half precision; the gradients are divided by it before the optimizer step. In
//! dynamic mode the scale adapts: an overflow (an inf or NaN gradient) divides it by
//! `scale_factor` (never below 1), and `scale_window` clean iterations counted from the last
//! overflow multiply it by `scale_factor` (never to a non-finite value, as PyTorch's
//! `GradScaler`).
//!
//! A scaler's state is serialisable for checkpoints; a state read back is checked as
//! [`LossScaler::new`] checks its arguments, so an edited or foreign checkpoint is an error that
//! names the field, never a panic later.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Whether the scale adapts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleMode {
    /// The scale never changes.
    Static,
    /// The scale backs off on overflow and grows after `scale_window` clean iterations.
    Dynamic,
}

/// The loss scale and its update rule; its whole state is serialisable for checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "ScalerState")]
pub struct LossScaler {
    cur_scale: f64,
    mode: ScaleMode,
    scale_factor: f64,
    /// On overflow the scale is multiplied by this (PyTorch's `backoff_factor`); `None`: divided
    /// by `scale_factor` (MMCV).
    backoff_factor: Option<f64>,
    scale_window: u64,
    /// Updates so far (MMCV's `cur_iter`).
    cur_iter: u64,
    /// The update at which the last overflow happened, -1 before any.
    last_overflow_iter: i64,
}

/// A scaler's state as stored, before it is checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScalerState {
    cur_scale: f64,
    mode: ScaleMode,
    scale_factor: f64,
    #[serde(default)]
    backoff_factor: Option<f64>,
    scale_window: u64,
    cur_iter: u64,
    last_overflow_iter: i64,
}

impl TryFrom<ScalerState> for LossScaler {
    type Error = Error;

    fn try_from(state: ScalerState) -> Result<Self> {
        let mut scaler = LossScaler::new(
            state.cur_scale,
            state.mode,
            state.scale_factor,
            state.scale_window,
        )?;
        if let Some(backoff) = state.backoff_factor {
            scaler = scaler.with_backoff_factor(backoff)?;
        }
        // An overflow at update k leaves `last_overflow_iter = k` and `cur_iter = k + 1`.
        if state.last_overflow_iter < -1
            || state.last_overflow_iter as i128 >= state.cur_iter as i128
        {
            return Err(Error::invalid(
                "last_overflow_iter",
                format!(
                    "must be -1 or an update before `cur_iter` ({}), got {}",
                    state.cur_iter, state.last_overflow_iter
                ),
            ));
        }
        scaler.cur_iter = state.cur_iter;
        scaler.last_overflow_iter = state.last_overflow_iter;
        Ok(scaler)
    }
}

/// MMCV's static loss scale when `[fp16]` names none (`Fp16OptimizerHook(loss_scale=512.)`).
pub const MMCV_STATIC_SCALE: f64 = 512.0;

/// PyTorch's `GradScaler` starts at 2^16.
pub const PYTORCH_INIT_SCALE: f64 = 65536.0;

impl Default for LossScaler {
    /// Dynamic, 2^32, factor 2, window 1000 (MMCV's defaults).
    fn default() -> Self {
        LossScaler::new(2f64.powi(32), ScaleMode::Dynamic, 2.0, 1000)
            .expect("MMCV's defaults are valid")
    }
}

impl LossScaler {
    /// A scaler starting at `init_scale`.
    ///
    /// Errors, naming the parameter, on an `init_scale` that is not a positive finite number,
    /// and in dynamic mode on a `scale_factor` that is not a finite number above 1 or a zero
    /// `scale_window`.
    pub fn new(
        init_scale: f64,
        mode: ScaleMode,
        scale_factor: f64,
        scale_window: u64,
    ) -> Result<Self> {
        if !(init_scale.is_finite() && init_scale > 0.0) {
            return Err(Error::invalid(
                "init_scale",
                format!("the loss scale must be a positive finite number, got {init_scale}"),
            ));
        }
        if mode == ScaleMode::Dynamic {
            if !(scale_factor.is_finite() && scale_factor > 1.0) {
                return Err(Error::invalid(
                    "scale_factor",
                    format!("must be a finite number above 1, got {scale_factor}"),
                ));
            }
            if scale_window == 0 {
                return Err(Error::invalid(
                    "scale_window",
                    "must be at least 1 iteration in dynamic mode, got 0",
                ));
            }
        }
        Ok(LossScaler {
            cur_scale: init_scale,
            mode,
            scale_factor,
            backoff_factor: None,
            scale_window,
            cur_iter: 0,
            last_overflow_iter: -1,
        })
    }

    /// On overflow, multiply the scale by `backoff` (in `(0, 1)`) instead of dividing it by the
    /// growth factor (PyTorch's `GradScaler` has both).
    pub fn with_backoff_factor(mut self, backoff: f64) -> Result<Self> {
        if !(backoff > 0.0 && backoff < 1.0) {
            return Err(Error::invalid(
                "backoff_factor",
                format!("must be in (0, 1), got {backoff}"),
            ));
        }
        self.backoff_factor = Some(backoff);
        Ok(self)
    }

    /// A scaler from its stored state (as `serde_json` wrote it), checked as [`LossScaler::new`]
    /// checks its arguments; errors name the field.
    pub fn from_state(state: serde_json::Value) -> Result<Self> {
        let state: ScalerState = serde_json::from_value(state)
            .map_err(|error| Error::state("loss scaler state", error))?;
        Self::try_from(state)
    }

    /// A static scaler (MMCV's `loss_scale = 512.0`).
    pub fn fixed(scale: f64) -> Result<Self> {
        Self::new(scale, ScaleMode::Static, 2.0, 1000)
    }

    /// The current scale.
    pub fn loss_scale(&self) -> f64 {
        self.cur_scale
    }

    /// The mode.
    pub fn mode(&self) -> ScaleMode {
        self.mode
    }

    /// Updates so far (MMCV's `cur_iter`): 0 before the run's first step.
    pub fn updates(&self) -> u64 {
        self.cur_iter
    }

    /// What to say when the run's very first step overflows at the initial scale (call it
    /// before [`LossScaler::update_scale`]): a dynamic scale halves on each overflow and skips
    /// each such step, so from MMCV's 2^32 a model learns nothing for its first dozen or so
    /// steps, with no other sign than a loss that does not move. `None` after the first update,
    /// without an overflow, or in static mode.
    pub fn first_overflow_advice(&self, overflow: bool) -> Option<String> {
        if !overflow || self.cur_iter != 0 || self.mode != ScaleMode::Dynamic {
            return None;
        }
        let scale = self.cur_scale;
        let factor = self.backoff_factor.map_or(self.scale_factor, |b| 1.0 / b);
        let mut advice = format!(
            "the run's first step overflowed at the initial loss scale {scale} (2^{:.0}) and was \
             skipped; a dynamic scale is lowered on each overflow and skips each such step, so \
             the model does not learn until it falls low enough",
            scale.log2()
        );
        if scale > PYTORCH_INIT_SCALE {
            let steps = ((scale / PYTORCH_INIT_SCALE).ln() / factor.ln()).ceil();
            advice.push_str(&format!(
                " (from here to PyTorch's 65536, {steps} more overflows). To start lower, set \
                 `init_scale = 65536.0` (PyTorch's GradScaler): `[fp16] loss_scale = \
                 {{ init_scale = 65536.0 }}` in a config, or `LossScaler::new(65536.0, \
                 ScaleMode::Dynamic, 2.0, 1000)` in Rust"
            ));
        } else {
            advice.push_str(
                ". If the loss itself is finite, start lower: a smaller `init_scale` (`[fp16] \
                 loss_scale = { init_scale = ... }`)",
            );
        }
        Some(advice)
    }

    /// Updates the scale after an iteration (MMCV's rule). Static mode: nothing changes, not
    /// even the count. Growth that would reach a non-finite scale is skipped.
    pub fn update_scale(&mut self, overflow: bool) {
        if self.mode == ScaleMode::Static {
            return;
        }
        if overflow {
            let lowered = match self.backoff_factor {
                Some(backoff) => self.cur_scale * backoff,
                None => self.cur_scale / self.scale_factor,
            };
            self.cur_scale = lowered.max(1.0);
            self.last_overflow_iter = self.cur_iter as i64;
        } else {
            // In i128: neither a window above i64::MAX nor a long run can wrap.
            let since = self.cur_iter as i128 - self.last_overflow_iter as i128;
            if since % self.scale_window as i128 == 0 {
                let grown = self.cur_scale * self.scale_factor;
                if grown.is_finite() {
                    self.cur_scale = grown;
                }
            }
        }
        self.cur_iter += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_mmcv_s() {
        let scaler = LossScaler::default();
        assert_eq!(scaler.loss_scale(), 4294967296.0);
        assert_eq!(scaler.mode(), ScaleMode::Dynamic);
    }

    #[test]
    fn invalid_parameters_are_errors_naming_the_parameter() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let error = LossScaler::new(bad, ScaleMode::Dynamic, 2.0, 1000).unwrap_err();
            assert!(error.to_string().contains("init_scale"), "{error}");
        }
        let error = LossScaler::new(512.0, ScaleMode::Dynamic, 1.0, 1000).unwrap_err();
        assert!(error.to_string().contains("scale_factor"), "{error}");
        let error = LossScaler::new(512.0, ScaleMode::Dynamic, f64::INFINITY, 1000).unwrap_err();
        assert!(error.to_string().contains("scale_factor"), "{error}");
        let error = LossScaler::new(512.0, ScaleMode::Dynamic, 2.0, 0).unwrap_err();
        assert!(error.to_string().contains("scale_window"), "{error}");
        // A static scaler does not use the factor or the window.
        assert!(LossScaler::new(512.0, ScaleMode::Static, 1.0, 0).is_ok());
    }

    #[test]
    fn a_first_step_overflowing_at_the_start_says_how_to_start_lower_once() {
        let mut scaler = LossScaler::default();
        assert_eq!(scaler.first_overflow_advice(false), None);
        let advice = scaler.first_overflow_advice(true).unwrap();
        assert!(
            advice.contains("4294967296") && advice.contains("16 more overflows"),
            "{advice}"
        );
        assert!(advice.contains("init_scale = 65536.0"), "{advice}");
        scaler.update_scale(true);
        assert_eq!(scaler.first_overflow_advice(true), None, "said once");
        // Already at PyTorch's start: no 65536 to suggest.
        let low = LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 1000).unwrap();
        let advice = low.first_overflow_advice(true).unwrap();
        assert!(!advice.contains("more overflows"), "{advice}");
        let fixed = LossScaler::fixed(512.0).unwrap();
        assert_eq!(fixed.first_overflow_advice(true), None);
    }
}
