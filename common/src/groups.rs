//! Gradient accumulation's groups: micro-batches per optimizer step (MMCV's `cumulative_iters`)
//! and the loss factor of each (MMCV's `GradientCumulativeOptimizerHook`).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Micro-batches per optimizer step, and MMCV's loss factor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Groups {
    cumulative_iters: usize,
}

impl Groups {
    /// A step every iteration (`cumulative_iters = 1`).
    pub const EVERY_ITERATION: Groups = Groups {
        cumulative_iters: 1,
    };

    /// Steps every `cumulative_iters` iterations; 0 is an error naming `cumulative_iters`.
    pub fn new(cumulative_iters: usize) -> Result<Self> {
        if cumulative_iters == 0 {
            return Err(Error::invalid(
                "cumulative_iters",
                "must be a positive integer, got 0",
            ));
        }
        Ok(Groups { cumulative_iters })
    }

    /// Micro-batches per step.
    pub fn cumulative_iters(self) -> usize {
        self.cumulative_iters
    }

    /// What the loss of iteration `iter` is divided by: `cumulative_iters` in the full groups,
    /// the size of the final short group in it (REFERENCE.md section 2).
    pub fn loss_factor(self, iter: usize, max_iters: usize) -> usize {
        let remainder = max_iters % self.cumulative_iters;
        if iter < max_iters - remainder {
            self.cumulative_iters
        } else {
            remainder
        }
    }

    /// Whether iteration `iter` (from 0) of a run of `max_iters` ends a group: the optimizer
    /// steps after it (MMCV's `every_n_iters(cumulative_iters) or is_last_iter`).
    pub fn ends_group(self, iter: usize, max_iters: usize) -> bool {
        (iter + 1).is_multiple_of(self.cumulative_iters) || iter + 1 == max_iters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmcvs_factors_and_group_ends() {
        let groups = Groups::new(3).unwrap();
        let factors: Vec<usize> = (0..8).map(|i| groups.loss_factor(i, 8)).collect();
        assert_eq!(factors, [3, 3, 3, 3, 3, 3, 2, 2]);
        let ends: Vec<usize> = (0..8).filter(|&i| groups.ends_group(i, 8)).collect();
        assert_eq!(ends, [2, 5, 7]);
        assert!(Groups::new(0)
            .unwrap_err()
            .to_string()
            .contains("cumulative_iters"));
    }
}
