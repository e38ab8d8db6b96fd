//! What the runner and its hooks share: the model, the optimizer, the position in the run, and
//! the current iteration's outputs.

use std::path::PathBuf;

use burn::optim::ModuleOptimizer;
use burn::prelude::*;

use crate::fp16::Fp16Module;
use crate::Result;

pub use memsave_common::train::{At, BatchFootprint, IterLog, PeerPlace};

/// A model the runner can train: it computes a scalar loss from a batch.
pub trait TrainModel: Module + Fp16Module + 'static {
    /// One batch of training data.
    type Batch;

    /// The mean loss over `batch`, a one-element tensor (any float precision).
    fn loss(&self, batch: Self::Batch) -> Tensor<1>;

    /// The loss and its named parts, which the log shows beside it (MMDetection's `loss_cls`
    /// and `loss_bbox`); only the loss is back-propagated. Default: [`TrainModel::loss`] and
    /// no parts.
    fn loss_with_parts(&self, batch: Self::Batch) -> (Tensor<1>, Vec<(&'static str, Tensor<1>)>) {
        (self.loss(batch), Vec::new())
    }
}

/// Training batches, the same for the same `(epoch, index)`: a resumed run sees exactly the
/// batches the uninterrupted run saw. Like Burn's `Batcher`, it is told the device to make each
/// batch on (the runner's).
pub trait DataSource<Batch> {
    /// Batches in one epoch (at least 1).
    fn batches_per_epoch(&self) -> usize;

    /// Batch `index` of `epoch`, on `device`.
    fn batch(&self, epoch: usize, index: usize, device: &Device) -> Result<Batch>;

    /// The memory the largest batch takes, when it is known before any batch is made.
    fn footprint(&self) -> Option<BatchFootprint> {
        None
    }
}

/// The state of a run, handed to every hook.
pub struct TrainState<M: TrainModel> {
    /// The weights being trained (the fp32 masters under mixed precision). Snapshots hold
    /// these.
    pub model: M,
    /// The model the forward runs on when it is not `model` (the half copy under mixed
    /// precision), set by the optimizer hook.
    pub forward_model: Option<M>,
    /// The optimizer, which steps `model` (Burn's, or memsave's `Adam8`, `Weights16`, ...).
    pub optimizer: ModuleOptimizer,
    /// Where tensors live (an autodiff device).
    pub device: Device,
    /// The iteration being run, from 0 (MMCV's `runner.iter`); before the run, the first one.
    pub iter: usize,
    /// The epoch of `iter`.
    pub epoch: usize,
    /// The position of `iter` in its epoch.
    pub inner_iter: usize,
    /// Iterations in the whole run.
    pub max_iters: usize,
    /// Batches per epoch.
    pub iters_per_epoch: usize,
    /// Whether the run is counted in epochs (MMCV's `EpochBasedRunner`).
    pub by_epoch: bool,
    /// The learning rate for this iteration, set by the learning-rate hook before each
    /// iteration (NaN until a hook sets it: the runner then stops with an error, never trains
    /// at a silent 0).
    pub lr: f64,
    /// The loss of this iteration, until the optimizer hook consumes it.
    pub loss: Option<Tensor<1>>,
    /// This iteration's values for the log.
    pub log: IterLog,
    /// Set by a hook to have the runner write a snapshot there after this iteration.
    pub save_request: Option<PathBuf>,
    /// Set when a snapshot is due after this iteration: the hooks' `before_snapshot` runs
    /// first.
    pub snapshot_due: bool,
    /// The run's directory: snapshots and the log file.
    pub work_dir: PathBuf,
    /// How many times this iteration runs its forward and backward: 1, or 2 where a hook asks
    /// for it in `before_iter` (the step in backward with clipping or mixed precision: a norm
    /// pass, then a step pass). The second forward sees the same batch, the same random draws
    /// and the running statistics as the first did.
    pub forward_passes: usize,
    /// The pass under way (0, or 1 in the second of two).
    pub pass: usize,
    /// This run's place among data-parallel peers; rank 0 of 1 when training alone (the only
    /// place on Burn 0.22 so far).
    pub peer: PeerPlace,
    warnings: Vec<String>,
}

impl<M: TrainModel> TrainState<M> {
    pub(crate) fn new(
        model: M,
        optimizer: ModuleOptimizer,
        device: Device,
        work_dir: PathBuf,
    ) -> Self {
        TrainState {
            model,
            forward_model: None,
            optimizer,
            device,
            iter: 0,
            epoch: 0,
            inner_iter: 0,
            max_iters: 0,
            iters_per_epoch: 1,
            by_epoch: true,
            lr: f64::NAN,
            loss: None,
            log: IterLog::default(),
            save_request: None,
            snapshot_due: false,
            work_dir,
            forward_passes: 1,
            pass: 0,
            peer: PeerPlace::ALONE,
            warnings: Vec::new(),
        }
    }

    /// The model the forward runs on.
    pub fn forward_model(&self) -> &M {
        self.forward_model.as_ref().unwrap_or(&self.model)
    }

    /// Where the iteration stands in the run.
    pub fn at(&self) -> At {
        At {
            iter: self.iter,
            epoch: self.epoch,
            inner_iter: self.inner_iter,
            iters_per_epoch: self.iters_per_epoch,
            max_iters: self.max_iters,
            by_epoch: self.by_epoch,
        }
    }

    /// Whether this peer logs and writes snapshots (rank 0, or training alone).
    pub fn is_main(&self) -> bool {
        self.peer.rank == 0
    }

    /// Whether this is the last iteration of its group of `n` (MMCV's `every_n_iters`).
    pub fn every_n_iters(&self, n: usize) -> bool {
        self.at().every_n_iters(n)
    }

    /// Whether this is the run's last iteration.
    pub fn is_last_iter(&self) -> bool {
        self.at().is_last_iter()
    }

    /// Reports a warning (a `tracing` event with target `memsave`, on the main peer only) and
    /// keeps it for [`TrainState::warnings`].
    pub fn warn(&mut self, message: impl Into<String>) {
        let message = message.into();
        if self.is_main() {
            tracing::warn!(target: "memsave", "{message}");
        }
        self.warnings.push(message);
    }

    /// Every warning of the run so far.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}
