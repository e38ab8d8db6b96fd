//! Training: the runner and its state, the optimizers, the gradient operations of the
//! optimizer hook, and snapshots of a run on disk.

pub mod grads;
mod hook;
pub(crate) mod optim;
pub mod optim8;
pub mod params;
pub mod quant;
mod runner;
pub mod snapshot;
mod state;
pub(crate) mod tapping;
pub(crate) mod taps;
pub mod weights;

pub use hook::{Hook, Priority};
pub use memsave_common::train::RunLength;
pub use optim::{
    host_step_seconds, reset_host_step_seconds, Optim, OptimizerKind, OptimizerSpec, StateDtype,
};
pub use runner::Runner;
pub use snapshot::{load_weights, Snapshot, SnapshotMeta};
pub use state::{
    At, BatchFootprint, DataSource, IterLog, PeerPlace, TrainModel, TrainState, STEP_GROUP_BYTES,
};
pub use weights::{
    StepRounding, WeightDtype, WeightDtypeExt, WeightRounding, WeightSpec, WeightStore,
};
