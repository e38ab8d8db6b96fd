//! Training: the runner and its state, the optimizers, the gradient operations of the
//! optimizer hook, and snapshots of a run on disk.

pub mod grads;
mod hook;
mod length;
pub mod optim;
pub mod params;
pub mod runner;
pub mod snapshot;
pub mod state;

pub use hook::{Hook, Priority};
pub use length::RunLength;
pub use optim::{Optim, OptimizerKind};
pub use runner::Runner;
pub use snapshot::{load_weights, Snapshot, SnapshotMeta};
pub use state::{BatchFootprint, DataSource, IterLog, PeerPlace, TrainModel, TrainState};
