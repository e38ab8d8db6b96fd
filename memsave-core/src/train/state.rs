//! What the runner and its hooks share: the model, the optimizer, the position in the run, and
//! the current iteration's outputs.

use std::path::PathBuf;

use burn::module::AutodiffModule;
use burn::prelude::{Backend, Tensor};
use burn::tensor::backend::AutodiffBackend;

use super::optim::Optim;
use crate::fp16::Fp16Module;
use crate::Result;

pub use memsave_common::train::{At, BatchFootprint, IterLog, PeerPlace};

/// Bytes of gradients (at 4 bytes an element) per group of parameters the optimizer steps at
/// once (see [`TrainState::step`]).
pub const STEP_GROUP_BYTES: usize = 16 << 20;

/// A model the runner can train: it computes a scalar loss from a batch.
pub trait TrainModel<B: AutodiffBackend>: AutodiffModule<B> + Fp16Module + 'static {
    /// One batch of training data.
    type Batch;

    /// The mean loss over `batch`, a one-element tensor (any float precision).
    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1>;

    /// The loss and its named parts, which the log shows beside it (MMDetection's `loss_cls`
    /// and `loss_bbox`); only the loss is back-propagated. Default: [`TrainModel::loss`] and
    /// no parts.
    fn loss_with_parts(
        &self,
        batch: Self::Batch,
    ) -> (Tensor<B, 1>, Vec<(&'static str, Tensor<B, 1>)>) {
        (self.loss(batch), Vec::new())
    }
}

/// Training batches, the same for the same `(epoch, index)`: a resumed run sees exactly the
/// batches the uninterrupted run saw. Like Burn's `Batcher<B, I, O>`, it is told the device to
/// make each batch on (the runner's; each data-parallel peer's own).
pub trait DataSource<B: Backend, Batch> {
    /// Batches in one epoch (at least 1).
    fn batches_per_epoch(&self) -> usize;

    /// Batch `index` of `epoch`, on `device`.
    fn batch(&self, epoch: usize, index: usize, device: &B::Device) -> Result<Batch>;

    /// The memory the largest batch takes, when it is known before any batch is made; the
    /// runner checks it against the memory available before training starts.
    fn footprint(&self) -> Option<BatchFootprint> {
        None
    }
}

/// The state of a run, handed to every hook.
pub struct TrainState<B: AutodiffBackend, M: TrainModel<B>> {
    /// The weights being trained (fp32 master weights under mixed precision). Checkpoints hold
    /// these; under mixed precision with optimizer offload, during the run, the half copy the
    /// forward runs on (the masters are on the host: see `masters_on_host`).
    pub model: M,
    /// The model the forward runs on when it is not `model` (the half copy under mixed
    /// precision), set by the optimizer hook.
    pub forward_model: Option<M>,
    /// The optimizer, which steps `model`.
    pub optimizer: Optim<B, M>,
    /// Where tensors live.
    pub device: B::Device,
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
    pub loss: Option<Tensor<B, 1>>,
    /// This iteration's values for the log.
    pub log: IterLog,
    /// Set by a hook to have the runner write a checkpoint there after this iteration.
    pub save_request: Option<PathBuf>,
    /// Set on every peer when a snapshot is due after this iteration (rank 0 alone writes it):
    /// the hooks' `before_snapshot` runs everywhere first.
    pub snapshot_due: bool,
    /// The whole optimizer state, gathered for the snapshot being written when each peer
    /// holds a part of it (ZeRO); rank 0's own state otherwise.
    pub whole_optimizer: Option<Vec<u8>>,
    /// Whether each peer holds only a part of the optimizer state (ZeRO): a snapshot then
    /// needs [`TrainState::whole_optimizer`].
    pub sharded_optimizer: bool,
    /// The trained model's record for the snapshot being written, where `model` does not hold
    /// the weights a snapshot saves (the fp32 masters on the host, see `masters_on_host`).
    pub(crate) whole_model: Option<Vec<u8>>,
    /// Under mixed precision with optimizer offload, training alone: the fp32 model whose
    /// trainable weights are in host memory as the masters (a one-element placeholder for each
    /// here), while `model` is the half copy the forward runs on and the device keeps no fp32
    /// weight (DeepSpeed's ZeRO-Offload). The optimizer hook puts the masters back into it after
    /// the run; snapshots save them.
    pub(crate) masters_on_host: Option<M>,
    /// The run's directory: checkpoints and the log file.
    pub work_dir: PathBuf,
    /// The optimizer's settings, where the run was made from them ([`super::Runner::new`]):
    /// the step on the host builds its own state from them.
    pub(crate) optimizer_spec: Option<super::OptimizerSpec>,
    /// Bytes of optimizer state per byte of trainable weights (for the memory check):
    /// [`super::OptimizerSpec::state_per_weight`].
    pub optimizer_state_per_weight: f64,
    /// Bytes of gradients per group of parameters the optimizer steps at once (see
    /// [`TrainState::step`]); [`STEP_GROUP_BYTES`] unless changed.
    pub step_group_bytes: usize,
    /// This run's place among data-parallel peers ([`crate::parallel::attach`] sets it);
    /// rank 0 of 1 when training alone.
    pub peer: PeerPlace,
    /// How many times this iteration's forward runs: 1, or 2 when a hook sets it in
    /// `before_iter` (the optimizer's step in backward under clipping or loss scaling needs
    /// every gradient's norm before any step: a first pass finds it, a second steps). The
    /// second forward gets the same batch (the data source gives it again), replays the first
    /// one's dropout masks and batch statistics (memsave's layers), and leaves running
    /// statistics alone. The hooks' `after_first_pass` follows the first forward, `after_iter`
    /// the second; a hook may set it back to 1 in `after_first_pass` (an overflow skips the
    /// step), and `after_iter` follows at once. Reset to 1 before each iteration.
    pub forward_passes: usize,
    /// Which forward of this iteration ran last, from 0.
    pub pass: usize,
    /// The taps of a pass that uses each gradient as soon as it is final (the step in backward,
    /// ZeRO stage 2's reduction to the owners), kept across iterations for their depth chain.
    pub(crate) tapping: super::tapping::Tapping<B>,
    /// The trainable weights in 16 bits (parameter compression): the rounding of each update
    /// and its state; `None` with fp32 weights.
    pub(crate) weights: Option<super::weights::WeightStore<B::InnerBackend>>,
    /// The whole store of 16-bit weights for the snapshot being written, gathered from the
    /// peers where each holds a part (ZeRO: each peer's Kahan compensations).
    pub(crate) whole_weights: Option<Vec<u8>>,
    warnings: Vec<String>,
}

impl<B: AutodiffBackend, M: TrainModel<B>> TrainState<B, M> {
    pub(crate) fn new(
        model: M,
        optimizer: Optim<B, M>,
        device: B::Device,
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
            whole_optimizer: None,
            sharded_optimizer: false,
            whole_model: None,
            masters_on_host: None,
            work_dir,
            optimizer_spec: None,
            optimizer_state_per_weight: 0.0,
            step_group_bytes: STEP_GROUP_BYTES,
            peer: PeerPlace::ALONE,
            forward_passes: 1,
            pass: 0,
            tapping: Default::default(),
            weights: None,
            whole_weights: None,
            warnings: Vec::new(),
        }
    }

    /// The model the forward runs on.
    pub fn forward_model(&self) -> &M {
        self.forward_model.as_ref().unwrap_or(&self.model)
    }

    /// The 16-bit weights' store (parameter compression), where the weights are compressed.
    pub fn weight_store(&self) -> Option<&super::weights::WeightStore<B::InnerBackend>> {
        self.weights.as_ref()
    }

    /// This peer's rank in a data-parallel run (0 when training alone).
    pub fn rank(&self) -> usize {
        self.peer.rank
    }

    /// Whether this peer logs and writes checkpoints (rank 0, or training alone).
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// The number of peers (1 when training alone).
    pub fn world_size(&self) -> usize {
        self.peer.world_size
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

    /// Keeps a warning already said (as an event, with its own fields) for
    /// [`TrainState::warnings`].
    pub(crate) fn keep_warning(&mut self, message: String) {
        self.warnings.push(message);
    }

    /// Every warning of the run so far.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
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

    /// Whether this is the last iteration of its group of `n` (MMCV's `every_n_iters`).
    pub fn every_n_iters(&self, n: usize) -> bool {
        self.at().every_n_iters(n)
    }

    /// Whether this is the run's last iteration.
    pub fn is_last_iter(&self) -> bool {
        self.at().is_last_iter()
    }

    /// Steps the optimizer on `model` with `grads`.
    ///
    /// The step runs a group of parameters at a time (about `step_group_bytes` of gradients
    /// each, in the model's order): each parameter is updated exactly as by one step over all
    /// of them, but only one group's new weights and optimizer state exist beside the old ones
    /// at any moment, and each group's gradients are freed as soon as it has stepped.
    pub fn step(&mut self, grads: burn::optim::GradientsParams) {
        self.step_with(grads, &mut |_, _| {});
    }

    /// [`TrainState::step`], calling `prepare` on each group's gradients first (the mixed
    /// precision hook casts, unscales and clips them there, so that no full fp32 copy of the
    /// half gradients is ever made).
    pub fn step_with(
        &mut self,
        grads: burn::optim::GradientsParams,
        prepare: &mut dyn FnMut(&M, &mut burn::optim::GradientsParams),
    ) {
        let group_bytes = self.step_group_bytes;
        let groups = super::grads::into_chunks::<B, M>(&self.model, grads, group_bytes);
        self.log.step_groups = groups.len();
        for mut group in groups {
            prepare(&self.model, &mut group);
            let Some(store) = self.weights.as_mut() else {
                self.model = self.optimizer.step(self.lr, self.model.clone(), group);
                continue;
            };
            // 16-bit weights: this group's widened to fp32 for its step, rounded back after.
            let (wide, old) = super::weights::model::widen::<B, M>(self.model.clone(), &group);
            let stepped = self.optimizer.step(self.lr, wide, group);
            self.model = super::weights::model::narrow::<B, M>(stepped, old, store);
        }
        self.end_weight_step();
        self.log.stepped = true;
    }

    /// The end of an optimizer step for the 16-bit weights: the step counted, the share of
    /// updates that left their weight unchanged logged; f16 weights losing updates warn once.
    pub(crate) fn end_weight_step(&mut self) {
        let Some(store) = self.weights.as_mut() else {
            return;
        };
        let spec = store.spec();
        let first = store.last_step().is_none();
        let Some(figures) = store.end_step() else {
            return;
        };
        self.log.weights_unchanged = Some(figures.fraction());
        if let Some(warning) = figures
            .first_step_warning(spec.dtype, spec.rounding)
            .filter(|_| first)
        {
            self.warn(warning);
        }
    }
}
