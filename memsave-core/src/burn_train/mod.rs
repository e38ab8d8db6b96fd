//! memsave's strategies in Burn's own training loop: burn-train's `Learner` and
//! `SupervisedTraining`, with their metrics, checkpoints and dashboard, gain mixed precision with
//! MMCV/PyTorch loss scaling, MMCV-exact gradient accumulation and global-norm clipping
//! (feature `burn-train`).
//!
//! Burn 0.21's loop sums accumulated gradients instead of averaging them, steps the learning
//! rate on every micro-batch and drops a final partial group; it clips per tensor; it has no
//! loss scaling. Its `Learner` is built from three parts (a model that is a `TrainStep`, an
//! `Optimizer`, an `LrScheduler`), and memsave wraps each, sharing one state:
//!
//! - [`MemsaveModel`]: the `TrainStep`. Your model implements [`ForwardStep`] (the forward
//!   that returns the output with its loss: the body of your `TrainStep::step` without the
//!   `backward`) and the wrapper back-propagates `loss / factor` (times the loss scale, through a
//!   half copy of the weights, under mixed precision), adding the gradients to the group's sums.
//! - [`MemsaveOptimizer`]: your optimizer, stepped at the end of each group (every
//!   `cumulative_iters` micro-batches and at the run's last one), after unscaling, the overflow
//!   check (an inf or NaN skips the step and lowers the scale) and global-norm clipping. Its
//!   record holds the loss scaler and the iteration count beside your optimizer's, so Burn's own
//!   checkpoints resume them.
//! - [`MemsaveScheduler`]: your scheduler, stepped once per optimizer step.
//!
//! ```ignore
//! let memsave = Memsave::new()
//!     .fp16(LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 1000)?)
//!     .accumulate(4, num_epochs * batches_per_epoch)?
//!     .clip_grad_norm(1.0)?;
//! let learner = memsave.learner(model, AdamConfig::new().init(), 1e-3)?; // was Learner::new(..)
//! let result = training.launch(learner);
//! ```
//!
//! Burn's own `grads_accumulation` must stay off: memsave groups the micro-batches itself.
//! The adapters are for burn-train's single-device strategy (`step_multi` adds the devices'
//! gradients first, as Burn does, and then steps as [`MemsaveOptimizer`] always does).

mod failure;
mod metrics;
mod model;
mod optim;
mod schedule;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::module::AutodiffModule;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::train::{InferenceStep, Learner, LearningComponentsMarker};

use crate::fp16::{Fp16Module, Precision};
use crate::hooks::{GradClip, Groups};
use crate::scaler::LossScaler;
use crate::{Error, Result};

pub use metrics::{MemsaveMetric, MemsaveMetrics, Quantity};
pub use model::{ForwardStep, LossOutput, MemsaveModel};
pub use optim::MemsaveOptimizer;
pub use schedule::MemsaveScheduler;

/// Burn's `Learner` over memsave's three adapters.
pub type MemsaveLearner<B, M, O, S> = Learner<
    LearningComponentsMarker<B, MemsaveScheduler<S>, MemsaveModel<B, M>, MemsaveOptimizer<O>>,
>;

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
    /// With 16-bit weights, at a step: the share of non-zero updates that left their weight
    /// unchanged.
    pub weights_unchanged: Option<f64>,
}

/// The precision part: the scaler, and the half type of the forward copy.
#[derive(Clone, Debug)]
pub(crate) struct Mixed {
    pub(crate) scaler: LossScaler,
    pub(crate) precision: Precision,
}

/// The 16-bit weights' store, of the backend the model trains on (`WeightStore<K>`), behind
/// what the backend-free state needs of it.
pub(crate) trait ErasedStore: Send {
    fn to_bytes(&self) -> Vec<u8>;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

impl<K: burn::prelude::Backend> ErasedStore for crate::train::WeightStore<K> {
    fn to_bytes(&self) -> Vec<u8> {
        crate::train::WeightStore::to_bytes(self)
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// The trainable weights in 16 bits ([`Memsave::weights`]).
pub(crate) struct Weights {
    pub(crate) spec: crate::train::WeightSpec,
    /// Made at the first step, on the model's backend.
    pub(crate) store: Option<Box<dyn ErasedStore>>,
    /// A checkpoint's store, until the store is made.
    pub(crate) saved: Option<Vec<u8>>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights").field("spec", &self.spec).finish()
    }
}

/// The state the three adapters share.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) mixed: Option<Mixed>,
    /// The trainable weights in 16 bits, where asked.
    pub(crate) weights: Option<Weights>,
    pub(crate) groups: Option<Groups>,
    /// Micro-batches in the whole run (for the final partial group), with accumulation.
    pub(crate) max_iters: Option<usize>,
    pub(crate) grad_clip: Option<GradClip>,
    /// Micro-batches the optimizer has seen.
    pub(crate) iter: usize,
    /// Micro-batches the model has stepped (to tell Burn's own accumulation is on too).
    pub(crate) forwards: usize,
    /// The current group's gradient sums (fp32).
    pub(crate) summed: Option<GradientsParams>,
    pub(crate) last: StepReport,
    /// Steps skipped on overflow so far.
    pub(crate) skipped_steps: usize,
    /// The current micro-batch's loss, until the optimizer records it.
    pub(crate) pending_loss: Option<metrics::LazyLoss>,
    /// Every micro-batch, for the metrics.
    pub(crate) history: metrics::History,
    /// The run's length, learnt from burn-train's progress (`accumulate_auto`).
    pub(crate) run_length: metrics::RunLength,
    /// Whether `Memsave::metrics` was called.
    pub(crate) metrics_registered: bool,
    /// Whether the first step's check of the `with_cp` switches ran.
    pub(crate) checked_segments: bool,
    pub(crate) warnings: Vec<String>,
    /// The error that stopped the training, until [`Memsave::finish`] takes it.
    pub(crate) failure: Option<Error>,
    /// burn-train's handle that stops the training (from the registration of
    /// [`Memsave::metrics`]).
    pub(crate) interrupter: Option<Interrupter>,
    /// The user's live [`Memsave`] handles (clones of one): a failure kept for
    /// [`Memsave::finish`] needs one to be taken.
    pub(crate) handles: usize,
    /// The run's context ([`crate::run`]): what the model's steps run in.
    pub(crate) context: Option<crate::RunContext>,
    pub(crate) warned_past_end: bool,
    pub(crate) warned_burn_accumulation: bool,
}

impl Shared {
    pub(crate) fn groups(&self) -> Groups {
        self.groups.unwrap_or(Groups::EVERY_ITERATION)
    }

    /// The run's micro-batches, learnt from burn-train's progress (`accumulate_auto`).
    pub(crate) fn set_derived_length(&mut self, total: usize) {
        if self.max_iters.is_none() && total > 0 {
            self.max_iters = Some(total);
        }
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
        self.last.skipped_steps = self.skipped_steps;
        let seen = metrics::Seen {
            report: self.last.clone(),
            loss: self.pending_loss.take(),
        };
        self.history.push(seen);
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

    pub(crate) fn warn(&mut self, message: String) {
        tracing::warn!(target: "memsave", "{message}");
        self.warnings.push(message);
    }

    /// The run's context.
    pub(crate) fn context(&mut self) -> crate::RunContext {
        self.context.get_or_insert_with(crate::run::current).clone()
    }

    /// The state kept in Burn's optimizer checkpoints, as JSON.
    pub(crate) fn state_json(&self) -> String {
        let weights = self.weights.as_ref().and_then(|weights| {
            let bytes = match &weights.store {
                Some(store) => store.to_bytes(),
                None => weights.saved.clone()?,
            };
            Some(bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
        });
        serde_json::json!({
            "iter": self.iter,
            "loss_scaler": self.mixed.as_ref().map(|mixed| &mixed.scaler),
            "weights": weights,
        })
        .to_string()
    }

    /// Restores [`Shared::state_json`]'s state.
    pub(crate) fn load_state_json(&mut self, json: &str) -> Result<()> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|error| Error::state("memsave state", error))?;
        let iter = value
            .get("iter")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| Error::invalid("iter", "missing or not a count"))?;
        if let Some(mixed) = &mut self.mixed {
            match value.get("loss_scaler") {
                Some(saved) if !saved.is_null() => {
                    mixed.scaler = LossScaler::from_state(saved.clone())?;
                }
                _ => self.warn(
                    "the checkpoint was trained without mixed precision: the loss scaler \
                     starts afresh at its init_scale"
                        .to_string(),
                ),
            }
        }
        let mut notice = None;
        if let Some(weights) = &mut self.weights {
            let hex = value.get("weights").and_then(serde_json::Value::as_str);
            let bytes = hex.map(|hex| {
                (0..hex.len() / 2)
                    .map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("zz"), 16))
                    .collect::<std::result::Result<Vec<u8>, _>>()
            });
            match bytes {
                Some(Ok(bytes)) => weights.saved = Some(bytes),
                Some(Err(_)) => {
                    return Err(Error::invalid("weights", "the weights' store is damaged"))
                }
                None => {
                    notice = Some(format!(
                        "the checkpoint was trained with fp32 weights, and this run keeps them \
                         in {}: they are rounded to nearest as it starts",
                        weights.spec.describe()
                    ))
                }
            }
        }
        if let Some(notice) = notice {
            self.warn(notice);
        }
        self.iter = iter as usize;
        self.forwards = self.iter;
        self.summed = None;
        Ok(())
    }
}

/// burn-train's interrupter, with the `Debug` that [`Shared`] derives.
#[derive(Clone, Default)]
pub(crate) struct Interrupter(pub(crate) burn::train::Interrupter);

impl std::fmt::Debug for Interrupter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interrupter")
    }
}

/// Locks the shared state (a panic elsewhere while it was held leaves it usable).
pub(crate) fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The strategies for a burn-train run, and the adapters that carry them out (see the
/// [module docs](self)).
///
/// An error that stops the training is returned by [`Memsave::finish`]; where the program
/// never takes it, dropping the last `Memsave` handle panics with it (and where nothing can stop
/// burn-train's loop, the next optimizer step does): an error is never silent. Not covered: a
/// program that leaves without dropping its handle (`std::process::exit`, `mem::forget`, a
/// `static`).
#[derive(Debug)]
pub struct Memsave {
    shared: Arc<Mutex<Shared>>,
}

impl Default for Memsave {
    fn default() -> Self {
        Self::new()
    }
}

impl Memsave {
    /// fp32, a step every micro-batch, no clipping: Burn's loop as it is, until a strategy
    /// is switched on. Its run's context ([`crate::run`]) is the run of this thread (installed,
    /// or the thread's own, as a [`crate::train::Runner`]'s): the model's steps run in it, with
    /// the choices made there.
    pub fn new() -> Self {
        let shared = Shared {
            context: Some(crate::run::current()),
            handles: 1,
            ..Shared::default()
        };
        Memsave {
            shared: Arc::new(Mutex::new(shared)),
        }
    }

    /// The run's context: its settings and figures.
    pub fn context(&self) -> crate::RunContext {
        lock(&self.shared).context()
    }

    /// What the run does when a module is switched on without a `#[with_cp]` method
    /// ([`crate::checkpoint::UnusedWithCp`]; by default the training stops with an error,
    /// [`Memsave::finish`]'s).
    pub fn unused_with_cp(self, unused: crate::checkpoint::UnusedWithCp) -> Result<Self> {
        self.context()
            .scope(|| crate::checkpoint::set_unused_with_cp(unused))?;
        Ok(self)
    }

    /// After the training: the error that stopped it, if any (burn-train's `launch` returns
    /// none of its own). Call it after `launch`: `memsave.finish()?`.
    pub fn finish(&self) -> Result<()> {
        match lock(&self.shared).failure.take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Mixed precision: the forward and backward run on a `precision` copy of the weights,
    /// the loss multiplied by `scaler`'s scale; the weights, the optimizer state and the
    /// gradient sums stay fp32 (MMCV's `Fp16OptimizerHook`, PyTorch's `GradScaler`).
    pub fn mixed_precision(self, scaler: LossScaler, precision: Precision) -> Self {
        lock(&self.shared).mixed = Some(Mixed { scaler, precision });
        self
    }

    /// The trainable weights in 16 bits as their only copy (parameter compression,
    /// [`crate::train::weights`]): the model is cast to `spec`'s type, the forward runs on it
    /// (bf16 without a loss scale; f16 with PyTorch's dynamic scaler, unless
    /// [`Memsave::mixed_precision`] says otherwise), each chunk of parameters is widened to fp32
    /// for your optimizer's step and rounded back by `spec`'s rounding. The optimizer's
    /// checkpoint holds the rounding's state. Frozen weights held compressed are memsave's
    /// runner's (an error names `frozen`).
    pub fn weights(self, spec: crate::train::WeightSpec) -> Result<Self> {
        if spec.frozen.is_some() {
            return Err(Error::invalid(
                "frozen",
                "frozen weights held compressed need memsave's runner (its check of the layers \
                 that read them): leave `frozen` unset with burn-train",
            ));
        }
        {
            let mut shared = lock(&self.shared);
            shared.weights = spec.is_compressed().then(|| Weights {
                spec,
                store: None,
                saved: None,
            });
            if let (Some(precision), None) = (spec.dtype.precision(), &shared.mixed) {
                let scaler = match precision {
                    Precision::Bf16 => {
                        LossScaler::new(1.0, crate::scaler::ScaleMode::Static, 2.0, 1000)?
                    }
                    Precision::F16 => {
                        LossScaler::new(65536.0, crate::scaler::ScaleMode::Dynamic, 2.0, 1000)?
                    }
                };
                shared.mixed = Some(Mixed { scaler, precision });
            }
        }
        Ok(self)
    }

    /// [`Memsave::mixed_precision`] in f16.
    pub fn fp16(self, scaler: LossScaler) -> Self {
        self.mixed_precision(scaler, Precision::F16)
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
            shared.run_length.wanted = false;
        }
        Ok(self)
    }

    /// [`Memsave::accumulate`] with the run's length learnt from burn-train: the number of
    /// epochs from its progress, the micro-batches per epoch when the first epoch ends (read by
    /// [`Memsave::metrics`], which must be registered). Until the length is known, and in a run
    /// of one epoch, a final partial group is divided by `cumulative_iters`, as if the run went
    /// on; give the length with [`Memsave::accumulate`] where it matters.
    pub fn accumulate_auto(self, cumulative_iters: usize) -> Result<Self> {
        let groups = Groups::new(cumulative_iters)?;
        {
            let mut shared = lock(&self.shared);
            shared.groups = Some(groups);
            shared.max_iters = None;
            shared.run_length.wanted = true;
        }
        Ok(self)
    }

    /// memsave's burn-train metrics: the loss, the loss scale and the steps skipped (mixed
    /// precision), the micro-batch's place in its group (accumulation) and the gradients' norm,
    /// for burn-train's renderers and loggers without a renderer of your own:
    /// `SupervisedTraining::new(..).metrics(memsave.metrics())`. Call it after the strategies
    /// are set.
    pub fn metrics(&self) -> MemsaveMetrics {
        MemsaveMetrics::new(&self.shared)
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

    /// `model` as the learner's `TrainStep`. Errors when mixed precision is on and the model is
    /// already half (the wrapper keeps the fp32 masters and makes the half copy itself).
    pub fn model<B, M>(&self, model: M) -> Result<MemsaveModel<B, M>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + Fp16Module,
    {
        MemsaveModel::new(model, self.shared.clone())
    }

    /// `optimizer`, stepped at the end of each group.
    pub fn optimizer<O>(&self, optimizer: O) -> MemsaveOptimizer<O> {
        MemsaveOptimizer::new(optimizer, self.shared.clone())
    }

    /// `scheduler`, stepped once per optimizer step.
    pub fn scheduler<S: LrScheduler>(&self, scheduler: S) -> MemsaveScheduler<S> {
        MemsaveScheduler::new(scheduler, self.shared.clone())
    }

    /// Burn's `Learner::new` over the three adapters: the one line that changes in a
    /// burn-train program.
    pub fn learner<B, M, O, S>(
        &self,
        model: M,
        optimizer: O,
        scheduler: S,
    ) -> Result<MemsaveLearner<B, M, O, S>>
    where
        B: AutodiffBackend,
        M: ForwardStep + AutodiffModule<B> + Fp16Module + core::fmt::Display + 'static,
        M::Output: LossOutput<B>,
        M::InnerModule: InferenceStep,
        O: Optimizer<M, B> + 'static,
        S: LrScheduler + 'static,
    {
        Ok(Learner::new(
            self.model(model)?,
            self.optimizer(optimizer),
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

    /// Every warning so far (each was also printed).
    pub fn warnings(&self) -> Vec<String> {
        lock(&self.shared).warnings.clone()
    }
}
