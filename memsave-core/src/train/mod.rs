//! Training: the runner and its state, optimizers, gradient operations, checkpoints.

pub mod checkpoint;
pub mod optim;
pub mod runner;
pub mod state;

pub use checkpoint::{Checkpoint, CheckpointMeta};
pub use optim::{Optim, OptimizerKind};
pub use runner::{Hook, RunLength, Runner};
pub use state::{BatchFootprint, DataSource, IterLog, TrainModel, TrainState};
