//! The hooks of MMCV's runner, on Burn: the optimizer hooks (plain, mixed precision, gradient
//! accumulation, and the last two together), the learning-rate schedule, checkpoints and the
//! log. Each is a policy plugged into [`crate::train::Runner`].

mod checkpoint;
mod cumulative;
mod fp16;
mod logger;
mod lr;
mod optimizer;

pub use checkpoint::CheckpointHook;
pub use cumulative::{GradientCumulativeFp16OptimizerHook, GradientCumulativeOptimizerHook};
pub use fp16::Fp16OptimizerHook;
pub use logger::LoggerHook;
pub use lr::{LrSchedule, LrUpdaterHook, StepPolicy, Warmup};
pub use optimizer::{GradClip, OptimizerHook};
