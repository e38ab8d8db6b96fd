//! Training: the runner and its state, the optimizers, the gradient operations of the
//! optimizer hook, and snapshots of a run on disk.

pub mod grads;
pub mod optim;
pub mod params;
pub mod runner;
pub mod snapshot;
pub mod state;

pub use optim::{Optim, OptimizerKind};
pub use runner::{Hook, RunLength, Runner};
pub use snapshot::{load_weights, Snapshot, SnapshotMeta};
pub use state::{BatchFootprint, DataSource, IterLog, TrainModel, TrainState};
