//! The optimizers the runner drives: SGD with momentum and weight decay, Adam, AdamW.

mod optimizer;
mod spec;
mod steps;

pub use optimizer::Optim;
pub use spec::{OptimizerKind, OptimizerSpec, StateDtype};
pub(crate) use steps::ParamSteps;
