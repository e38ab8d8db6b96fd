//! The runner's Burn-free parts (MMCV's runner and hooks), shared by the runner on Burn 0.21
//! (memsave-core) and on Burn 0.22.1 (memsave-next): how long a run is, the order hooks run in,
//! where an iteration stands, what it logs, the learning-rate schedule, and when snapshots are
//! written.

pub mod length;
pub mod log;
pub mod lr;
pub mod snapshots;

pub use length::RunLength;
pub use log::{LogBook, LogConfig};
pub use lr::{LrSchedule, Policy, Warmup};
pub use snapshots::{SnapshotConfig, SnapshotSchedule};

/// Where an iteration stands in its run: what the log line and the snapshots' names read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct At {
    /// The iteration, from 0 (MMCV's `runner.iter`).
    pub iter: usize,
    /// Its epoch, from 0.
    pub epoch: usize,
    /// Its position in its epoch, from 0.
    pub inner_iter: usize,
    /// Batches per epoch.
    pub iters_per_epoch: usize,
    /// Iterations in the whole run.
    pub max_iters: usize,
    /// Whether the run is counted in epochs.
    pub by_epoch: bool,
}

impl At {
    /// Whether this is the last iteration of its group of `n` (MMCV's `every_n_iters`).
    pub fn every_n_iters(&self, n: usize) -> bool {
        n > 0 && (self.iter + 1).is_multiple_of(n)
    }

    /// Whether this is the run's last iteration.
    pub fn is_last_iter(&self) -> bool {
        self.iter + 1 == self.max_iters
    }
}

/// When a hook runs at each hook point, before or after the others (MMCV's `Priority`): hooks
/// of a higher priority run first; hooks of one priority run in the order they were
/// registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// MMCV's `HIGHEST` (0).
    Highest,
    /// MMCV's `VERY_HIGH` (10): before the optimizer hook (the weight broadcast of a
    /// data-parallel run).
    VeryHigh,
    /// MMCV's `HIGH` (30).
    High,
    /// MMCV's `ABOVE_NORMAL` (40): the optimizer hook.
    AboveNormal,
    /// MMCV's `NORMAL` (50): the runner's `register_hook`.
    Normal,
    /// MMCV's `BELOW_NORMAL` (60).
    BelowNormal,
    /// MMCV's `LOW` (70).
    Low,
    /// MMCV's `VERY_LOW` (90).
    VeryLow,
    /// MMCV's `LOWEST` (100).
    Lowest,
}

/// The memory one batch takes, and how a user makes it smaller.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchFootprint {
    /// Bytes of the batch's tensors.
    pub bytes: u64,
    /// The batch in words: `8 images of 3 x 224 x 224 (fp32)`.
    pub what: String,
    /// The settings that make it smaller, in the user's words: ``lower `data.samples_per_gpu`
    /// or `data.image_size` ``.
    pub smaller: String,
}

/// Per-iteration values for the log.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IterLog {
    /// The loss of the iteration (unscaled, undivided).
    pub loss: Option<f64>,
    /// Global gradient norm before clipping, at the iterations that stepped.
    pub grad_norm: Option<f64>,
    /// The loss scale, under mixed precision.
    pub loss_scale: Option<f64>,
    /// Whether the optimizer stepped (false while accumulating, or on an overflow).
    pub stepped: bool,
    /// Whether the step was skipped on a gradient overflow (mixed precision).
    pub overflow: bool,
    /// The groups of parameters the step ran in (see the runner's `TrainState::step`); 0 without a step.
    pub step_groups: usize,
    /// The named parts of the loss (`TrainModel::loss_with_parts`).
    pub parts: Vec<(&'static str, f64)>,
    /// With 16-bit weights, at the iterations that stepped: the share of non-zero updates
    /// that left their 16-bit weight unchanged.
    pub weights_unchanged: Option<f64>,
}

/// Which of the peers of a data-parallel run a state belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerPlace {
    /// Its rank, from 0 (rank 0 logs and writes snapshots).
    pub rank: usize,
    /// The number of peers.
    pub world_size: usize,
    /// The first rank of the peers in this process (which share its host memory).
    pub local_first: usize,
    /// The number of peers in this process (1 where each process has one).
    pub local_peers: usize,
}

impl PeerPlace {
    /// Training alone: rank 0 of 1.
    pub const ALONE: PeerPlace = PeerPlace {
        rank: 0,
        world_size: 1,
        local_first: 0,
        local_peers: 1,
    };

    /// Peer `rank` of `world_size`, alone in its process.
    pub fn new(rank: usize, world_size: usize) -> Self {
        PeerPlace {
            rank,
            world_size,
            local_first: rank,
            local_peers: 1,
        }
    }

    /// The ranks of the peers in this process (its own rank alone where the fields do not hold
    /// it).
    pub fn local_ranks(&self) -> std::ops::Range<usize> {
        let local = self.local_first..self.local_first + self.local_peers.max(1);
        if local.contains(&self.rank) {
            local
        } else {
            self.rank..self.rank + 1
        }
    }
}
