//! The optimizers the runner drives: SGD with momentum and weight decay, Adam, AdamW.

mod host;
mod optimizer;
mod spec;
mod steps;

pub use host::{host_step_seconds, reset_host_step_seconds};
pub(crate) use host::{prepare, timed, to_host, Host, HostState, HostSteps, HostSums};
pub use optimizer::Optim;
pub use spec::{OptimizerKind, OptimizerSpec, StateDtype};
pub(crate) use steps::ParamSteps;
