//! The learning rate of every iteration (MMCV's `lr_config`): the schedule each runtime's
//! `LrUpdaterHook` reads before each iteration.

use serde::Deserialize;
use smart_default::SmartDefault;

use crate::{Error, Result};

/// How the learning rate decays after warm-up (MMCV's `lr_config.policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Constant.
    #[default]
    Fixed,
    /// Multiplied by `gamma` at each milestone of `step` (MMDetection's 1x schedule:
    /// `step = [8, 11]`).
    Step,
}

/// The warm-up at the start of training (MMCV's `lr_config.warmup`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Warmup {
    /// `ratio * lr` during warm-up.
    Constant,
    /// From `ratio * lr` to `lr`, linearly.
    Linear,
    /// From `ratio * lr` to `lr`, exponentially.
    Exp,
}

/// The learning rate of every iteration (MMCV's `StepLrUpdaterHook` with warm-up), as
/// `lr_config` writes it; the base rate is the optimizer's `lr`.
#[derive(Clone, Debug, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct LrSchedule {
    /// The learning rate before any decay (the optimizer's `lr`).
    #[serde(skip)]
    pub base_lr: f64,
    /// The decay.
    #[default(Policy::Fixed)]
    pub policy: Policy,
    /// Milestones of the `step` policy: epochs, or iterations when not counted by epoch.
    pub step: Vec<usize>,
    /// The decay factor at each milestone.
    #[default(0.1)]
    pub gamma: f64,
    /// Whether the milestones count epochs; `None`: as the runner counts.
    pub by_epoch: Option<bool>,
    /// The warm-up, if any.
    pub warmup: Option<Warmup>,
    /// Iterations of warm-up.
    pub warmup_iters: usize,
    /// The warm-up's starting fraction of the learning rate.
    #[default(0.1)]
    pub warmup_ratio: f64,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> Self {
        LrSchedule {
            base_lr: lr,
            ..Self::default()
        }
    }

    /// Checks the values; errors name the parameter.
    pub fn validate(&self) -> Result<()> {
        if !(self.base_lr.is_finite() && self.base_lr >= 0.0) {
            return Err(Error::invalid(
                "lr",
                format!("must be a non-negative number, got {}", self.base_lr),
            ));
        }
        if self.warmup.is_some() && !(self.warmup_ratio > 0.0 && self.warmup_ratio <= 1.0) {
            return Err(Error::invalid(
                "warmup_ratio",
                format!("must be in (0, 1], got {}", self.warmup_ratio),
            ));
        }
        if self.policy == Policy::Step {
            if !(self.gamma.is_finite() && self.gamma > 0.0) {
                return Err(Error::invalid(
                    "gamma",
                    format!("must be a positive number, got {}", self.gamma),
                ));
            }
            if self.step.windows(2).any(|pair| pair[0] >= pair[1]) {
                return Err(Error::invalid(
                    "step",
                    format!("milestones must increase, got {:?}", self.step),
                ));
            }
        }
        Ok(())
    }

    /// The learning rate at iteration `iter` of epoch `epoch`.
    ///
    /// `by_epoch` unset counts milestones in epochs.
    pub fn lr_at(&self, iter: usize, epoch: usize) -> f64 {
        let regular = match self.policy {
            Policy::Fixed => self.base_lr,
            Policy::Step => {
                let progress = if self.by_epoch.unwrap_or(true) {
                    epoch
                } else {
                    iter
                };
                let passed = self.step.iter().filter(|&&step| progress >= step).count();
                self.base_lr * self.gamma.powi(passed as i32)
            }
        };
        match self.warmup {
            Some(warmup) if iter < self.warmup_iters => {
                let remaining = 1.0 - iter as f64 / self.warmup_iters as f64;
                match warmup {
                    Warmup::Constant => regular * self.warmup_ratio,
                    Warmup::Linear => regular * (1.0 - remaining * (1.0 - self.warmup_ratio)),
                    Warmup::Exp => regular * self.warmup_ratio.powf(remaining),
                }
            }
            _ => regular,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule() -> LrSchedule {
        LrSchedule {
            base_lr: 0.01,
            policy: Policy::Step,
            step: vec![8, 11],
            gamma: 0.1,
            by_epoch: Some(true),
            warmup: Some(Warmup::Linear),
            warmup_iters: 500,
            warmup_ratio: 0.001,
        }
    }

    #[test]
    fn linear_warmup_rises_from_the_ratio_to_the_base() {
        let s = schedule();
        assert!((s.lr_at(0, 0) - 0.01 * 0.001).abs() < 1e-12);
        // Halfway: 1 - 0.5 * 0.999 of the base.
        assert!((s.lr_at(250, 0) - 0.01 * (1.0 - 0.5 * 0.999)).abs() < 1e-12);
        assert_eq!(s.lr_at(500, 0), 0.01);
    }

    #[test]
    fn steps_decay_by_gamma_at_each_milestone_epoch() {
        let s = schedule();
        assert_eq!(s.lr_at(10_000, 7), 0.01);
        assert!((s.lr_at(10_000, 8) - 0.001).abs() < 1e-12);
        assert!((s.lr_at(10_000, 11) - 0.0001).abs() < 1e-12);
    }

    #[test]
    fn invalid_milestones_are_errors_naming_the_key() {
        let mut s = schedule();
        s.step = vec![11, 8];
        assert!(s.validate().unwrap_err().to_string().contains("`step`"));
    }
}
