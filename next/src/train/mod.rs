//! Training on Burn 0.22 as MMCV's runner does it: [`Runner`] owns the loop, hooks own the
//! policies ([`crate::hooks`]: the optimizer hook with mixed precision, accumulation and
//! clipping, the learning-rate schedule, snapshots, the log).
//!
//! ```rust,ignore
//! let optimizer = AdamWConfig::new().init();
//! let hook = Fp16OptimizerHook::new(LossScaler::dynamic()?)?; // or OptimizerHook::new()
//! let mut runner = Runner::new(model, optimizer, Box::new(hook), data,
//!                              RunLength::Epochs(12), "work_dirs/run", device)?;
//! runner.register_hook_at(Box::new(LrUpdaterHook::new(schedule)?), Priority::VeryHigh);
//! runner.register_hook(Box::new(SnapshotHook::new(1, true)));
//! runner.register_hook(Box::new(LoggerHook::new(50)));
//! runner.run()?;
//! ```
//!
//! Not yet on Burn 0.22 (the port's later slices): data-parallel peers and ZeRO, activation
//! offload, the memory check before the run and the reading of a device's out-of-memory panic.

mod hook;
mod optimizer;
pub(crate) mod params;
mod runner;
mod state;
pub(crate) mod step;
pub(crate) mod taps;

use burn::prelude::*;
use burn::tensor::DType;

pub use hook::{Hook, Priority};
pub use memsave_common::train::RunLength;
pub use optimizer::{optimizer, OptimizerKind, OptimizerSpec, StateDtype};
pub use runner::Runner;
pub use state::{At, BatchFootprint, DataSource, IterLog, PeerPlace, TrainModel, TrainState};

/// A one-element tensor's value, read as f64 (waits for the device).
pub(crate) fn scalar(tensor: &Tensor<1>) -> f64 {
    tensor.clone().cast(DType::F32).into_scalar::<f64>()
}
