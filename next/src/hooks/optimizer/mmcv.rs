//! MMCV's four optimizer hooks by their names: the corners of [`OptimizerHook`]'s precision and
//! grouping.

use super::OptimizerHook;
use crate::fp16::Precision;
use crate::scaler::{LossScaler, MMCV_STATIC_SCALE};
use crate::Result;
use memsave_common::groups::Groups;

/// MMCV's `Fp16OptimizerHook`: mixed precision with fp32 master weights and loss scaling, a
/// step every iteration. Before the run the forward model becomes a half copy of the weights
/// (`wrap_fp16_model`); each iteration back-propagates `loss * scale` through it, casts the half
/// gradients onto the fp32 weights and divides them by the scale; on any inf or NaN the step is
/// skipped (weights and optimizer state untouched) and the scale backs off, else the gradients
/// are clipped, the fp32 weights step and the half copy is made again.
pub struct Fp16OptimizerHook;

impl Fp16OptimizerHook {
    /// The hook, in f16 (`OptimizerHook::with_mixed_precision` for bf16).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(loss_scaler: LossScaler) -> OptimizerHook {
        OptimizerHook::new().with_mixed_precision(loss_scaler, Precision::F16)
    }

    /// MMCV's default: a static scale of 512.
    #[allow(clippy::should_implement_trait)]
    pub fn default() -> OptimizerHook {
        Self::new(LossScaler::fixed(MMCV_STATIC_SCALE).expect("512 is a valid scale"))
    }
}

/// MMCV's `GradientCumulativeOptimizerHook`: each iteration back-propagates `loss / factor`
/// and adds the gradients up; the optimizer steps every `cumulative_iters` iterations and at
/// the last one.
pub struct GradientCumulativeOptimizerHook;

impl GradientCumulativeOptimizerHook {
    /// Steps every `cumulative_iters` iterations; 0 is an error.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(cumulative_iters: usize) -> Result<OptimizerHook> {
        Ok(OptimizerHook::new().with_groups(Groups::new(cumulative_iters)?))
    }
}

/// MMCV's `GradientCumulativeFp16OptimizerHook`: accumulation under mixed precision.
pub struct GradientCumulativeFp16OptimizerHook;

impl GradientCumulativeFp16OptimizerHook {
    /// Steps every `cumulative_iters` iterations; 0 is an error.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(cumulative_iters: usize, loss_scaler: LossScaler) -> Result<OptimizerHook> {
        Ok(Fp16OptimizerHook::new(loss_scaler).with_groups(Groups::new(cumulative_iters)?))
    }
}
