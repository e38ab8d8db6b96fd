//! The hooks of MMCV's runner on Burn 0.22: the optimizer hook (fp32, mixed precision or
//! 16-bit weights, every iteration or accumulating, with clipping), the learning-rate
//! schedule, snapshots, the log, and `"dynamic"`'s budget. Each is a policy plugged into [`crate::train::Runner`].

mod dynamic;
mod logger;
mod lr;
mod optimizer;
mod snapshot;

pub use crate::grads::GradClip;
pub use dynamic::DynamicHook;
pub use logger::{LogConfig, LoggerHook};
pub use lr::{LrSchedule, LrUpdaterHook, Policy, Warmup};
pub use optimizer::{
    Fp16OptimizerHook, GradientCumulativeFp16OptimizerHook, GradientCumulativeOptimizerHook,
    Groups, OptimizerHook,
};
pub use snapshot::{SnapshotConfig, SnapshotHook, SnapshotSchedule};
