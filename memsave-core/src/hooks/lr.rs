use burn::tensor::backend::AutodiffBackend;

use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// How the learning rate decays after warm-up.
#[derive(Clone, Debug, PartialEq)]
pub enum StepPolicy {
    /// Constant.
    Fixed,
    /// Multiplied by `gamma` at each milestone (MMDetection's 1x schedule: `step = [8, 11]`).
    Step {
        /// Epochs (or iterations, when the schedule is not by epoch) where it decays.
        steps: Vec<usize>,
        /// The decay factor.
        gamma: f64,
    },
}

/// The warm-up at the start of training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warmup {
    /// `ratio * lr` during warm-up.
    Constant,
    /// From `ratio * lr` to `lr`, linearly.
    Linear,
    /// From `ratio * lr` to `lr`, exponentially.
    Exp,
}

/// The learning rate of every iteration (MMCV's `StepLrUpdaterHook` with warm-up).
#[derive(Clone, Debug, PartialEq)]
pub struct LrSchedule {
    /// The learning rate before any decay.
    pub base_lr: f64,
    /// The decay.
    pub policy: StepPolicy,
    /// Whether `policy`'s steps count epochs (else iterations).
    pub by_epoch: bool,
    /// The warm-up, if any.
    pub warmup: Option<Warmup>,
    /// Iterations of warm-up.
    pub warmup_iters: usize,
    /// The warm-up's starting fraction of the learning rate.
    pub warmup_ratio: f64,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> Self {
        LrSchedule {
            base_lr: lr,
            policy: StepPolicy::Fixed,
            by_epoch: true,
            warmup: None,
            warmup_iters: 0,
            warmup_ratio: 1.0,
        }
    }

    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if !(self.base_lr.is_finite() && self.base_lr >= 0.0) {
            return Err(Error::invalid(
                "optimizer.lr",
                format!("must be a non-negative number, got {}", self.base_lr),
            ));
        }
        if self.warmup.is_some() && !(self.warmup_ratio > 0.0 && self.warmup_ratio <= 1.0) {
            return Err(Error::invalid(
                "lr_config.warmup_ratio",
                format!("must be in (0, 1], got {}", self.warmup_ratio),
            ));
        }
        if let StepPolicy::Step { steps, gamma } = &self.policy {
            if !(gamma.is_finite() && *gamma > 0.0) {
                return Err(Error::invalid(
                    "lr_config.gamma",
                    format!("must be a positive number, got {gamma}"),
                ));
            }
            if steps.windows(2).any(|pair| pair[0] >= pair[1]) {
                return Err(Error::invalid(
                    "lr_config.step",
                    format!("milestones must increase, got {steps:?}"),
                ));
            }
        }
        Ok(())
    }

    /// The learning rate at iteration `iter` of epoch `epoch`.
    pub fn lr_at(&self, iter: usize, epoch: usize) -> f64 {
        let regular = match &self.policy {
            StepPolicy::Fixed => self.base_lr,
            StepPolicy::Step { steps, gamma } => {
                let progress = if self.by_epoch { epoch } else { iter };
                let passed = steps.iter().filter(|&&step| progress >= step).count();
                self.base_lr * gamma.powi(passed as i32)
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

/// Sets `state.lr` before each iteration from a [`LrSchedule`].
#[derive(Clone, Debug)]
pub struct LrUpdaterHook {
    /// The schedule.
    pub schedule: LrSchedule,
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for LrUpdaterHook {
    fn name(&self) -> &'static str {
        "lr"
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        state.lr = self.schedule.lr_at(state.iter, state.epoch);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule() -> LrSchedule {
        LrSchedule {
            base_lr: 0.01,
            policy: StepPolicy::Step {
                steps: vec![8, 11],
                gamma: 0.1,
            },
            by_epoch: true,
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
        s.policy = StepPolicy::Step {
            steps: vec![11, 8],
            gamma: 0.1,
        };
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("lr_config.step"));
    }
}
