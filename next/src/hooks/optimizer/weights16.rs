//! The optimizer hook's 16-bit weights: the loss scale they imply without mixed precision, and
//! the share of updates each step leaves unchanged (logged; f16 warns at the first step).

use super::{Mixed, OptimizerHook};
use crate::fp16::Precision;
use crate::scaler::{LossScaler, ScaleMode, PYTORCH_INIT_SCALE};
use crate::train::{TrainModel, TrainState};

/// The forward of 16-bit weights of `precision` without mixed precision: bf16 without loss
/// scaling (a static scale of 1), f16 with a dynamic scale from PyTorch's 2^16.
pub(super) fn implied(precision: Precision) -> Mixed {
    let scaler = match precision {
        Precision::Bf16 => LossScaler::new(1.0, ScaleMode::Static, 2.0, 1000),
        Precision::F16 => LossScaler::new(PYTORCH_INIT_SCALE, ScaleMode::Dynamic, 2.0, 1000),
    }
    .expect("valid scaler settings");
    Mixed {
        scaler,
        precision,
        on_weights: true,
        implied: true,
    }
}

impl OptimizerHook {
    /// After a step of 16-bit weights: the share of updates that left their weight unchanged,
    /// logged; f16 weights losing updates warn at the run's first step.
    pub(super) fn log_rounding<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        let Some(precision) = self.weights16 else {
            return;
        };
        let counted = &mut self.rounding_counted;
        let Some((share, warning)) = crate::weights16::step_figures(precision, counted) else {
            return;
        };
        state.log.weights_unchanged = Some(share);
        if let Some(warning) = warning {
            state.warn(warning);
        }
    }
}
