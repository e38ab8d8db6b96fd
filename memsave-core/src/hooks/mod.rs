//! The hooks of MMCV's runner, on Burn: the optimizer hook (fp32 or mixed precision, every
//! iteration or accumulating, with clipping), the learning-rate schedule, snapshots and the
//! log. Each is a policy plugged into [`crate::train::Runner`].

mod logger;
mod lr;
mod offload;
mod optimizer;
mod snapshot;

pub use crate::train::grads::GradClip;
pub use logger::{LogConfig, LoggerHook};
pub use lr::{LrSchedule, LrUpdaterHook, Policy, Warmup};
pub use offload::OffloadHook;
pub use optimizer::{
    Alone, Fp16OptimizerHook, GradientCumulativeFp16OptimizerHook, GradientCumulativeOptimizerHook,
    Groups, OptimizerHook, Reducer,
};
pub use snapshot::{SnapshotConfig, SnapshotHook, SnapshotSchedule};
