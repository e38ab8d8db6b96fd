//! The optimizers the runner drives: SGD with momentum and weight decay, Adam, AdamW.

mod host;
mod optimizer;

mod steps;

pub use host::{host_step_seconds, reset_host_step_seconds};
pub(crate) use host::{prepare, timed, to_host, Host, HostState, HostSteps, HostSums};
pub use memsave_common::optim::{OptimizerKind, OptimizerSpec, StateDtype};
pub use optimizer::Optim;
pub(crate) use steps::ParamSteps;
