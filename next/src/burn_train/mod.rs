//! memsave's strategies in burn-train 0.22's own loop (`Learner`, `SupervisedTraining`, its
//! metrics, checkpoints and renderers): mixed precision with MMCV/PyTorch loss scaling,
//! MMCV-exact gradient accumulation and global-norm clipping (feature `burn-train`).
//!
//! Burn 0.22.1's loop has no loss scaling; its `grads_accumulation` sums gradients (in their
//! dtype) rather than averaging them and flushes a partial group at each epoch's end; its
//! clipping is per tensor. Its `Learner::new(model, ModuleOptimizer, scheduler)` takes a concrete
//! optimizer, so memsave's hook is the model's `TrainStep::optimize` (burn-train
//! `learner/train_val.rs`), and two parts are wrapped, sharing one state:
//!
//! - [`MemsaveModel`]: the `TrainStep` and `InferenceStep`. Your model implements
//!   [`ForwardStep`] (the body of your `TrainStep::step` without the `backward`); the wrapper
//!   back-propagates `loss / factor` (times the loss scale, through a half copy of the weights,
//!   under mixed precision) and, in `optimize`, adds the gradients to the group's fp32 sums; at
//!   a group's end (every `cumulative_iters` micro-batches and at the run's last) it unscales,
//!   skips the step on an inf or NaN (lowering the scale), clips by the global norm and steps
//!   your optimizer on the fp32 weights.
//! - [`MemsaveScheduler`]: your scheduler, stepped once per optimizer step (burn-train steps it
//!   on every micro-batch when its own accumulation is off, which memsave's needs).
//!
//! `"dynamic"` ([`Memsave::dynamic`], the learner from [`Memsave::dynamic_learner`]) keeps a
//! memory budget in every micro-batch's step at any batch or input size, exactly: memsave's
//! engine chooses at each segment's entry, as in memsave's runner.
//!
//! ```ignore
//! let memsave = Memsave::new()
//!     .fp16(LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 1000)?)
//!     .accumulate(4, num_epochs * batches_per_epoch)?
//!     .clip_grad_norm(1.0)?;
//! let learner = memsave.learner(model, AdamConfig::new().init(), 1e-3)?; // was Learner::new(..)
//! let result = SupervisedTraining::new(dir, train, valid)
//!     .with_interrupter(memsave.interrupter()) // memsave's errors stop the training cleanly
//!     .num_epochs(num_epochs)
//!     .launch(learner);
//! memsave.finish()?; // the error that stopped the training, if any (also in `result.error`)
//! ```
//!
//! An error that stops the training (a block switched on without a `#[with_cp]` method) is never
//! silent: with memsave's interrupter given to the training, burn-train stops after the step,
//! `LearningResult::error` holds it and [`Memsave::finish`] returns it; a program that never
//! calls `finish()` panics with it when its last `Memsave` is dropped; without the interrupter,
//! the next optimizer step panics with it, on burn-train's loop thread (the caller of `launch`).
//!
//! Burn's own `grads_accumulation` must stay off. The adapter runs on burn-train's single-device
//! strategy; several devices come with the port's data parallelism (slice 7), and until then
//! `optimize_multi` stops the training with an error saying so.

mod dynamic;
mod failure;
mod metrics;
mod model;
mod schedule;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::train::{InferenceStep, Interrupter, Learner};

use crate::checkpoint::UnusedWithCp;
use crate::fp16::{Fp16Module, Precision};
use crate::grads::GradClip;
use crate::{Error, Result};
use memsave_common::groups::Groups;
use memsave_common::scaler::{LossScaler, ScaleMode};

pub use metrics::{MemsaveMetric, MemsaveMetrics, Quantity};
pub use model::{ForwardStep, LossOutput, MemsaveModel};
pub use schedule::MemsaveScheduler;

/// What happened at the last micro-batch the optimizer saw.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The micro-batch, from 0 over the whole run.
    pub iter: usize,
    /// Whether the optimizer stepped (the end of a group, without overflow).
    pub stepped: bool,
    /// Whether the group's gradients held an inf or NaN (the step was skipped).
    pub overflow: bool,
    /// The global norm of the group's gradients (unscaled, before clipping), at a step.
    pub grad_norm: Option<f64>,
    /// The loss scale after the update, under mixed precision.
    pub loss_scale: Option<f64>,
    /// Optimizer steps skipped on overflow so far in the run.
    pub skipped_steps: usize,
    /// The micro-batch's place in its group, from 1.
    pub micro_batch: usize,
    /// The size of its group: `cumulative_iters`, or the final partial group's own.
    pub group_size: usize,
    /// With 16-bit weights, at a step: the share of the updates that left their weight
    /// unchanged (rounding to nearest: lost; stochastic: not drawn this time; Kahan: kept in
    /// the compensation).
    pub weights_unchanged: Option<f64>,
}

/// The precision part: the scaler, and the half type of the forward copy.
#[derive(Clone, Debug)]
pub(crate) struct Mixed {
    pub(crate) scaler: LossScaler,
    pub(crate) precision: Precision,
    /// The trainable weights themselves are in `precision` (16-bit weights): the forward runs
    /// on them, no copy is made.
    pub(crate) weights16: bool,
}

/// The state the adapters share.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) mixed: Option<Mixed>,
    pub(crate) groups: Option<Groups>,
    /// Micro-batches in the whole run (for the final partial group), with accumulation.
    pub(crate) max_iters: Option<usize>,
    pub(crate) grad_clip: Option<GradClip>,
    /// Micro-batches the optimizer has seen.
    pub(crate) iter: usize,
    /// Micro-batches the model has stepped (to tell Burn's own accumulation is on too).
    pub(crate) forwards: usize,
    /// The current group's gradient sums (the masters' dtype, scaled).
    pub(crate) summed: Option<GradientsParams>,
    pub(crate) last: StepReport,
    /// Steps skipped on overflow so far.
    pub(crate) skipped_steps: usize,
    /// The rates of the current group, every parameter group's (the user's scheduler's).
    pub(crate) lr: Option<ModuleLearningRate>,
    /// The current micro-batch's loss, until the optimizer records it.
    pub(crate) pending_loss: Option<metrics::LazyLoss>,
    /// Every micro-batch, for the metrics.
    pub(crate) history: metrics::History,
    /// Whether the first step's check of the `with_cp` switches ran.
    pub(crate) checked_segments: bool,
    /// Whether a step of the 16-bit weights was counted (the first one warns).
    pub(crate) rounding_counted: bool,
    pub(crate) unused_with_cp: UnusedWithCp,
    pub(crate) warnings: Vec<String>,
    /// The error that stopped the training, until [`Memsave::finish`] takes it.
    pub(crate) failure: Option<Error>,
    /// The interrupter given to burn-train ([`Memsave::interrupter`]).
    pub(crate) interrupter: Option<Interrupter>,
    /// The user's live [`Memsave`] handles (clones of one).
    pub(crate) handles: usize,
    /// `"dynamic"`, where [`Memsave::dynamic`] switched it on.
    pub(crate) dynamic: Option<dynamic::DynamicRun>,
    /// The run's context (memsave-common's `RunContext`, shared with memsave on Burn 0.21):
    /// what the model's steps run in.
    pub(crate) context: Option<memsave_common::run::RunContext>,
    pub(crate) warned_past_end: bool,
    pub(crate) warned_burn_accumulation: bool,
}

impl Shared {
    pub(crate) fn groups(&self) -> Groups {
        self.groups.unwrap_or(Groups::EVERY_ITERATION)
    }

    /// What micro-batch `iter`'s loss is divided by (MMCV's loss factor).
    pub(crate) fn loss_factor(&mut self, iter: usize) -> usize {
        let groups = self.groups();
        match self.max_iters {
            Some(max_iters) if iter < max_iters => groups.loss_factor(iter, max_iters),
            Some(max_iters) => {
                if !self.warned_past_end {
                    self.warned_past_end = true;
                    self.warn(format!(
                        "micro-batch {} is past the {max_iters} the run was said to have \
                         (`Memsave::accumulate(.., total_iters)`): the loss is divided by \
                         cumulative_iters ({}) from here on; give the run's number of \
                         iterations (epochs x batches per epoch)",
                        iter + 1,
                        groups.cumulative_iters()
                    ));
                }
                groups.cumulative_iters()
            }
            None => groups.cumulative_iters(),
        }
    }

    /// Whether micro-batch `iter` ends its group.
    pub(crate) fn ends_group(&self, iter: usize) -> bool {
        self.groups()
            .ends_group(iter, self.max_iters.unwrap_or(usize::MAX))
    }

    /// Micro-batch `iter`'s place in its group (from 1) and its group's size.
    pub(crate) fn place_in_group(&self, iter: usize) -> (usize, usize) {
        let groups = self.groups();
        let size = match self.max_iters {
            Some(max_iters) if iter < max_iters => groups.loss_factor(iter, max_iters),
            _ => groups.cumulative_iters(),
        };
        (iter % groups.cumulative_iters() + 1, size)
    }

    /// Records the micro-batch the optimizer just saw, for the metrics.
    pub(crate) fn record(&mut self) {
        let (micro_batch, group_size) = self.place_in_group(self.last.iter);
        self.last.micro_batch = micro_batch;
        self.last.group_size = group_size;
        let seen = metrics::Seen {
            report: self.last.clone(),
            loss: self.pending_loss.take(),
        };
        self.history.push(seen);
    }

    pub(crate) fn warn(&mut self, message: String) {
        tracing::warn!(target: "memsave", "{message}");
        self.warnings.push(message);
    }
}

/// Locks the shared state (a panic elsewhere while it was held leaves it usable).
pub(crate) fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The strategies for a burn-train run, and the adapters that carry them out (see the
/// [module docs](self)).
pub struct Memsave {
    shared: Arc<Mutex<Shared>>,
}

impl std::fmt::Debug for Memsave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shared = lock(&self.shared);
        f.debug_struct("Memsave")
            .field("mixed", &shared.mixed)
            .field("groups", &shared.groups)
            .field("max_iters", &shared.max_iters)
            .field("grad_clip", &shared.grad_clip)
            .finish()
    }
}

impl Default for Memsave {
    fn default() -> Self {
        Self::new()
    }
}

impl Memsave {
    /// fp32, a step every micro-batch, no clipping: Burn's loop as it is, until a strategy is
    /// switched on.
    pub fn new() -> Self {
        let shared = Shared {
            handles: 1,
            context: Some(memsave_common::run::current()),
            ..Shared::default()
        };
        Memsave {
            shared: Arc::new(Mutex::new(shared)),
        }
    }

    /// The run's context: the run installed on the thread that made this `Memsave`, or that
    /// thread's own. burn-train's training thread enters it for each step, so the segments'
    /// records (the `#[with_cp]` types that ran, the planner's recorder, a `"dynamic"` chooser)
    /// are this run's.
    pub fn context(&self) -> memsave_common::run::RunContext {
        lock(&self.shared)
            .context
            .get_or_insert_with(memsave_common::run::current)
            .clone()
    }

    /// What the run does when a module is switched on without a `#[with_cp]` method (by
    /// default the training stops with an error, [`Memsave::finish`]'s; `Warn` says it once and
    /// trains on without checkpointing it).
    pub fn unused_with_cp(self, unused: UnusedWithCp) -> Self {
        lock(&self.shared).unused_with_cp = unused;
        self
    }

    /// The interrupter to give burn-train (`SupervisedTraining::with_interrupter`): an error of
    /// memsave's then stops the training after its step, and reaches `LearningResult::error`
    /// as well as [`Memsave::finish`]. Without it, only a panic can stop burn-train's loop.
    pub fn interrupter(&self) -> Interrupter {
        lock(&self.shared)
            .interrupter
            .get_or_insert_with(Interrupter::new)
            .clone()
    }

    /// After the training: the error that stopped it, if any. Call it after `launch`:
    /// `memsave.finish()?`.
    pub fn finish(&self) -> Result<()> {
        let mut shared = lock(&self.shared);
        if let Some(error) = shared.failure.take() {
            return Err(error);
        }
        if shared.summed.take().is_some() {
            let (iter, max_iters) = (shared.iter, shared.max_iters);
            shared.warn(format!(
                "the run ended inside a group of micro-batches (after micro-batch {iter}, of the \
                 {} `Memsave::accumulate` was told): that group's gradients were never stepped; \
                 give the run's number of micro-batches (epochs x batches per epoch)",
                max_iters.map_or("?".to_string(), |m| m.to_string())
            ));
        }
        Ok(())
    }

    /// Mixed precision: the forward and backward run on a `precision` copy of the weights, the
    /// loss multiplied by `scaler`'s scale; the weights, the optimizer state and the gradient
    /// sums stay fp32 (MMCV's `Fp16OptimizerHook`, PyTorch's `GradScaler`).
    pub fn mixed_precision(self, scaler: LossScaler, precision: Precision) -> Self {
        lock(&self.shared).mixed = Some(Mixed {
            scaler,
            precision,
            weights16: false,
        });
        self
    }

    /// The trainable weights kept in 16 bits as their only copy (parameter compression): the
    /// model is cast to `precision` (`wrap_fp16_model`, fp32 islands kept), the forward runs on
    /// it, the group's gradients are summed, unscaled and clipped in fp32, and the optimizer
    /// steps the 16-bit weights. Give the learner a [`crate::weights16::Weights16`] optimizer,
    /// which steps each weight in fp32 and rounds it back (stochastically by default): Burn's
    /// own would step them in 16 bits, losing the updates below half their spacing. bf16 takes
    /// no loss scale; f16 takes PyTorch's dynamic one (2^16, factor 2, window 2000) unless
    /// `scaler` says otherwise.
    pub fn weights16(self, precision: Precision, scaler: Option<LossScaler>) -> Self {
        let scaler = scaler.unwrap_or_else(|| {
            match precision {
                Precision::Bf16 => LossScaler::new(1.0, ScaleMode::Static, 2.0, 1000),
                Precision::F16 => LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2000),
            }
            .expect("PyTorch's defaults are valid")
        });
        lock(&self.shared).mixed = Some(Mixed {
            scaler,
            precision,
            weights16: true,
        });
        self
    }

    /// [`Memsave::mixed_precision`] in f16.
    pub fn fp16(self, scaler: LossScaler) -> Self {
        self.mixed_precision(scaler, Precision::F16)
    }

    /// [`Memsave::mixed_precision`] in bf16, without loss scaling (bf16 has fp32's range).
    pub fn bf16(self) -> Self {
        let scaler = LossScaler::new(1.0, ScaleMode::Static, 2.0, 1000).expect("a valid scaler");
        self.mixed_precision(scaler, Precision::Bf16)
    }

    /// `cumulative_iters` micro-batches per optimizer step, each loss divided by
    /// `cumulative_iters`, and a final partial group divided by its own size (MMCV's
    /// `GradientCumulativeOptimizerHook`). `total_iters` is the run's number of micro-batches
    /// (epochs x batches per epoch): groups run on across epochs, as MMCV's do, and the last
    /// group ends with the run. Errors name the value.
    pub fn accumulate(self, cumulative_iters: usize, total_iters: usize) -> Result<Self> {
        let groups = Groups::new(cumulative_iters)?;
        if total_iters == 0 {
            return Err(Error::invalid(
                "total_iters",
                "must be the run's number of micro-batches (epochs x batches per epoch), got 0",
            ));
        }
        {
            let mut shared = lock(&self.shared);
            shared.groups = Some(groups);
            shared.max_iters = Some(total_iters);
        }
        Ok(self)
    }

    /// Clips the gradients by their global norm before each step (after unscaling; MMCV's
    /// `grad_clip`), not per tensor as Burn's own clipping does.
    pub fn grad_clip(self, clip: GradClip) -> Self {
        lock(&self.shared).grad_clip = Some(clip);
        self
    }

    /// [`Memsave::grad_clip`] by the 2-norm; errors name `max_norm`.
    pub fn clip_grad_norm(self, max_norm: f64) -> Result<Self> {
        Ok(self.grad_clip(GradClip::new(max_norm, 2.0)?))
    }

    /// memsave's burn-train metrics: the loss, the loss scale and the steps skipped (mixed
    /// precision), the micro-batch's place in its group (accumulation) and the gradients' norm,
    /// for burn-train's renderers and loggers: `SupervisedTraining::new(..).metrics(memsave
    /// .metrics())`. Registering them also gives memsave the training's interrupter, where
    /// [`Memsave::interrupter`] was not called. Call it after the strategies are set.
    pub fn metrics(&self) -> MemsaveMetrics {
        MemsaveMetrics::new(&self.shared)
    }

    /// `model` as the learner's `TrainStep`. Errors when mixed precision is on and the model is
    /// already half (the wrapper keeps the fp32 masters and makes the half copy itself).
    pub fn model<M: Module + Fp16Module>(&self, model: M) -> Result<MemsaveModel<M>> {
        MemsaveModel::new(model, self.shared.clone())
    }

    /// `scheduler` (a rate, a scheduler, or the `ModuleLrScheduler` a Burn scheduler config's
    /// `init()` makes), stepped once per optimizer step.
    pub fn scheduler(&self, scheduler: impl Into<ModuleLrScheduler>) -> MemsaveScheduler {
        MemsaveScheduler::new(scheduler, self.shared.clone())
    }

    /// Burn's `Learner::new` over memsave's model and scheduler: the one line that changes in a
    /// burn-train program.
    pub fn learner<M>(
        &self,
        model: M,
        optimizer: ModuleOptimizer,
        scheduler: impl Into<ModuleLrScheduler>,
    ) -> Result<Learner<MemsaveModel<M>>>
    where
        M: ForwardStep + InferenceStep + Module + Fp16Module + std::fmt::Display + 'static,
        <M as ForwardStep>::Output: LossOutput,
    {
        if lock(&self.shared).dynamic.is_some() {
            return Err(Error::invalid(
                "dynamic",
                "`Memsave::dynamic` chooses among the model's checkpointed segments: build the \
                 learner with `Memsave::dynamic_learner`",
            ));
        }
        Ok(Learner::new(
            self.model(model)?,
            optimizer,
            self.scheduler(scheduler),
        ))
    }

    /// The current loss scale, under mixed precision.
    pub fn loss_scale(&self) -> Option<f64> {
        lock(&self.shared)
            .mixed
            .as_ref()
            .map(|mixed| mixed.scaler.loss_scale())
    }

    /// Micro-batches the optimizer has seen so far.
    pub fn iterations(&self) -> usize {
        lock(&self.shared).iter
    }

    /// What happened at the last micro-batch.
    pub fn last_step(&self) -> StepReport {
        lock(&self.shared).last.clone()
    }

    /// The learning rates of the current group, every parameter group's, as the scheduler
    /// gave them (`None` before the first step).
    pub fn learning_rates(&self) -> Option<ModuleLearningRate> {
        lock(&self.shared).lr.clone()
    }

    /// Every warning so far (each was also said as an event with target `memsave`).
    pub fn warnings(&self) -> Vec<String> {
        lock(&self.shared).warnings.clone()
    }
}
