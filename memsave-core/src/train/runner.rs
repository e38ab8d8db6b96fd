//! The training loop (MMCV's `EpochBasedRunner` / `IterBasedRunner`). The loop owns the order of
//! things; hooks own the policies: the optimizer hook (precision, accumulation, clipping,
//! reduction over data-parallel peers), the learning-rate schedule, snapshots, logging,
//! profiling. A new strategy is a new hook, never an `if` here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;

use super::hook::{Hook, Hooks, Priority};
use super::optim::{Optim, OptimizerSpec};
use super::params::{param_bytes, param_shapes};
use super::snapshot::codec::{load_bytes, record_bytes};
use super::snapshot::{Snapshot, SnapshotMeta};
use super::state::{DataSource, IterLog, TrainModel, TrainState};
use super::RunLength;
use crate::hooks::LrUpdaterHook;
use crate::{Error, Result, RunContext};

/// The error of a run that no hook gave a learning rate.
fn no_learning_rate() -> Error {
    Error::invalid(
        "lr",
        "no learning rate was set, so the run would train at 0: call `Runner::set_lr(0.01)` \
         for a constant rate, register an `LrUpdaterHook` with a schedule \
         (`LrUpdaterHook::new(LrSchedule { base_lr: 0.01, ..Default::default() })`), or set `state.lr` in a \
         hook's `before_iter`",
    )
}

/// The training loop.
pub struct Runner<B: AutodiffBackend, M: TrainModel<B>, D: DataSource<B, M::Batch>> {
    state: TrainState<B, M>,
    data: D,
    hooks: Hooks<B, M>,
    /// The run's context ([`crate::run`]): the one installed on the thread that made the runner
    /// (a user's scope, a data-parallel peer's run), or that thread's own.
    context: RunContext,
}

impl<B, M, D> Runner<B, M, D>
where
    B: AutodiffBackend,
    M: TrainModel<B>,
    D: DataSource<B, M::Batch>,
{
    /// A runner for `model` on `data`; `optimizer_hook` does the backward pass and the step
    /// (at [`Priority::AboveNormal`], MMCV's).
    pub fn new(
        model: M,
        optimizer: impl Into<OptimizerSpec>,
        optimizer_hook: Box<dyn Hook<B, M>>,
        data: D,
        length: RunLength,
        work_dir: impl Into<PathBuf>,
        device: B::Device,
    ) -> Result<Self> {
        let iters_per_epoch = data.batches_per_epoch();
        if iters_per_epoch == 0 {
            return Err(Error::Data("the data set yields no batch".into()));
        }
        let optimizer = optimizer.into();
        optimizer.validate()?;
        let mut state = TrainState::new(model, Optim::new(&optimizer), device, work_dir.into());
        state.optimizer_state_per_weight = optimizer.state_per_weight();
        state.optimizer_spec = Some(optimizer.clone());
        if optimizer.weights.is_compressed() {
            state.weights = Some(super::weights::WeightStore::new(optimizer.weights));
        }
        state.iters_per_epoch = iters_per_epoch;
        (state.by_epoch, state.max_iters) = match length {
            RunLength::Epochs(epochs) => (true, epochs * iters_per_epoch),
            RunLength::Iters(iters) => (false, iters),
        };
        if state.max_iters == 0 {
            return Err(Error::invalid(
                "runner",
                "the run has no iteration (max_epochs or max_iters is 0)",
            ));
        }
        let mut hooks = Hooks::new();
        hooks.insert(optimizer_hook, Priority::AboveNormal);
        Ok(Runner {
            state,
            data,
            hooks,
            context: crate::run::current(),
        })
    }

    /// The run's context: its settings and figures (activation offload's
    /// [`crate::checkpoint::OffloadStats::of`], ...). Made where the runner was, or given with
    /// [`Runner::with_context`].
    pub fn context(&self) -> &RunContext {
        &self.context
    }

    /// Runs in `context` rather than in the run installed where the runner was made (a run of
    /// its own beside others on the same thread).
    pub fn with_context(mut self, context: RunContext) -> Self {
        self.context = context;
        self
    }

    /// Trains at the constant learning rate `lr` (an [`LrUpdaterHook`] at MMCV's `VERY_HIGH`
    /// priority). A run needs a learning rate: this, or an [`LrUpdaterHook`] with a schedule,
    /// or a hook of the user's that sets [`TrainState::lr`]; without one it stops with an
    /// error before its first step. Errors, naming `lr`, on a negative or non-finite rate.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        let hook = LrUpdaterHook::constant(lr)?;
        self.register_hook_at(Box::new(hook), Priority::VeryHigh);
        Ok(())
    }

    /// Adds a hook at [`Priority::Normal`]: after the optimizer hook, after the hooks added
    /// before it.
    pub fn register_hook(&mut self, hook: Box<dyn Hook<B, M>>) {
        self.register_hook_at(hook, Priority::Normal);
    }

    /// Adds a hook that runs after every hook of a priority above or equal to `priority`
    /// and before the others (MMCV's `register_hook(hook, priority)`).
    pub fn register_hook_at(&mut self, hook: Box<dyn Hook<B, M>>, priority: Priority) {
        self.hooks.insert(hook, priority);
    }

    /// The run's state.
    pub fn state(&self) -> &TrainState<B, M> {
        &self.state
    }

    /// The run's state, to set up before [`Runner::run`] (a data-parallel peer's place:
    /// [`crate::parallel::attach`]).
    pub fn state_mut(&mut self) -> &mut TrainState<B, M> {
        &mut self.state
    }

    /// The trained weights.
    pub fn into_model(self) -> M {
        // Frozen weights held compressed come back as their dequantized values.
        let frozen = self.context.part::<crate::nn::FrozenWeights>();
        crate::nn::frozen::expand(self.state.model, &frozen)
    }

    /// Runs from `state.iter` to the end.
    ///
    /// First it checks that what one step needs and that is known up front (the batch, the
    /// gradients, the optimizer state) fits in the memory available, so that a run that cannot
    /// fit ends with an error before it writes anything; a device allocator's out-of-memory
    /// failure during a step (CUDA) also ends the run with that error, not a panic. Checkpoints
    /// already written are left as they are.
    pub fn run(&mut self) -> Result<()> {
        let context = self.context.clone();
        context.scope(|| self.run_here())?
    }

    /// [`Runner::run`], in the run's context.
    fn run_here(&mut self) -> Result<()> {
        self.preflight()?;
        self.position();
        self.call(|hook, state| hook.before_run(state))?;
        let mut first_step = true;
        while self.state.iter < self.state.max_iters {
            let (epoch, index) = (self.state.epoch, self.state.inner_iter);
            if index == 0 {
                self.call(|hook, state| hook.before_epoch(state))?;
            }
            self.state.log = IterLog::default();
            self.state.forward_passes = 1;
            self.state.pass = 0;
            self.call(|hook, state| hook.before_iter(state))?;
            if self.state.lr.is_nan() {
                return Err(no_learning_rate());
            }

            let batch = self.data.batch(epoch, index, &self.state.device)?;
            self.step(batch, epoch, index)?;
            if std::mem::take(&mut first_step) {
                self.check_segments_ran()?;
            }
            self.save_if_requested()?;

            let end_of_epoch = index + 1 == self.state.iters_per_epoch;
            if end_of_epoch {
                self.call(|hook, state| hook.after_epoch(state))?;
                self.save_if_requested()?;
            }
            self.state.iter += 1;
            self.position();
        }
        self.call(|hook, state| hook.after_run(state))?;
        self.save_if_requested()
    }

    /// The forward of `batch`: the loss for the hooks, its parts for the log. A failure a
    /// segment recorded in it (activation offload past the host's limit) ends the step here,
    /// before its backward.
    fn forward(&mut self, batch: M::Batch) -> Result<()> {
        let (loss, parts) = crate::memory::in_phase(crate::memory::phase::FORWARD, || {
            self.state.forward_model().loss_with_parts(batch)
        });
        if let Some(failure) = crate::checkpoint::take_step_failure() {
            return Err(failure);
        }
        self.state.log.parts = parts
            .iter()
            .map(|(name, part)| (*name, super::grads::scalar(part)))
            .collect();
        self.state.loss = Some(loss);
        Ok(())
    }

    /// Forward, then the hooks' backward and optimizer step (twice when a hook asked for two
    /// passes: [`TrainState::forward_passes`]). A failure a segment recorded (activation
    /// offload: the host past its limit, a copy back lost) comes back as its [`Error`], with
    /// the iteration; a device's out-of-memory panic becomes [`Error::OutOfMemory`].
    fn step(&mut self, batch: M::Batch, epoch: usize, index: usize) -> Result<()> {
        // A device's server thread that runs out of memory (wgpu) panics there: kept.
        crate::memory::watch_other_threads();
        let _ = crate::memory::other_thread_panics();
        // A failure recorded outside a step (a segment run without the runner) is not this
        // step's.
        let _ = crate::run::take_failure();
        // The model's code is the user's and may panic, and Burn's device allocators panic
        // when they run out of memory: the one place a step's panic is caught
        // (`crate::memory::oom`).
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if self.state.forward_passes < 2 {
                self.forward(batch)?;
                return self.call(|hook, state| hook.after_iter(state));
            }
            // The first forward's random draws and batch statistics, for the second.
            let (forwarded, draws) = crate::checkpoint::context::recording(|| self.forward(batch));
            forwarded?;
            self.call(|hook, state| hook.after_first_pass(state))?;
            if self.state.forward_passes < 2 {
                // A hook gave the second pass up (an overflow): the iteration ends here.
                return self.call(|hook, state| hook.after_iter(state));
            }
            self.state.pass = 1;
            let batch = self.data.batch(epoch, index, &self.state.device)?;
            crate::checkpoint::context::repeating(draws, || self.forward(batch))?;
            self.call(|hook, state| hook.after_iter(state))
        }));
        let failed = match outcome {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(error)) => error,
            Err(payload) => {
                self.state.loss = None;
                // A failure the step recorded before it panicked is the cause (a lost device
                // fails the next operation on it too; past the host limit, a device may run
                // out of the memory offload would have saved): it is the error.
                if let Some(failure) = crate::checkpoint::take_step_failure() {
                    return Err(failure.in_step(self.state.iter, &self.state.work_dir));
                }
                crate::checkpoint::abandon_step();
                match crate::memory::oom::from_panic(payload) {
                    Ok(needed) => Error::OutOfMemory {
                        what: "a buffer the device allocator could not find room for".to_string(),
                        needed,
                        place: crate::memory::device_available_bytes(&self.state.device).0,
                        available: None,
                        advice: self.memory_advice(self.data.footprint().map(|f| f.smaller), true),
                    },
                    Err(payload) => std::panic::resume_unwind(payload),
                }
            }
        };
        self.state.loss = None;
        crate::checkpoint::abandon_step();
        Err(failed.in_step(self.state.iter, &self.state.work_dir))
    }

    /// After the first step: every module whose `with_cp` is on ran a `#[with_cp]` method
    /// (see [`crate::check::segments_ran`]).
    fn check_segments_ran(&mut self) -> Result<()> {
        if let Some(warning) = crate::check::segments_ran(&self.state.model)? {
            self.state.keep_warning(warning);
        }
        Ok(())
    }

    /// The sizes known before the first step, against the memory available.
    fn preflight(&self) -> Result<()> {
        let (place, available) = crate::memory::device_available_bytes(&self.state.device);
        let (Some(available), Some(batch)) = (available, self.data.footprint()) else {
            return Ok(());
        };
        let (_, trainable) = param_bytes::<B, M>(&self.state.model);
        // Gradients, and the optimizer state once it exists (the first step makes it): this
        // peer's shares of them (ZeRO).
        let (gradients, state) = self.hooks.held_shares(&self.state);
        let states = (trainable as f64 * gradients) as u64
            + (trainable as f64 * self.state.optimizer_state_per_weight * state) as u64;
        let needed = batch.bytes + states;
        if needed <= available {
            return Ok(());
        }
        let what = if batch.bytes > available {
            format!("the input batch ({}) alone", batch.what)
        } else {
            format!(
                "one step, before any activation: the input batch ({}, {}) and the gradients \
                 and optimizer state ({})",
                batch.what,
                crate::memory::human(batch.bytes),
                crate::memory::human(states)
            )
        };
        Err(Error::OutOfMemory {
            what,
            needed,
            place,
            available: Some(available),
            advice: self.memory_advice(Some(batch.smaller), batch.bytes <= available),
        })
    }

    /// What to change when a step does not fit: `smaller` (the data's settings that shrink a
    /// batch), and, where they can help (`strategies`), the strategies with the hooks' advice.
    fn memory_advice(&self, smaller: Option<String>, strategies: bool) -> String {
        let smaller = smaller.unwrap_or_else(|| "make the batch or the images smaller".to_string());
        if !strategies {
            return format!("{smaller} (no strategy makes the input batch itself smaller)");
        }
        let mut advice = format!(
            "{smaller}, or save memory with a strategy: mixed precision, gradient accumulation \
             over smaller batches, gradient checkpointing"
        );
        for more in self.hooks.out_of_memory_advice(&self.state) {
            advice = format!("{advice}; {more}");
        }
        advice
    }

    /// Epoch and position in it, from `iter`.
    fn position(&mut self) {
        self.state.epoch = self.state.iter / self.state.iters_per_epoch;
        self.state.inner_iter = self.state.iter % self.state.iters_per_epoch;
    }

    /// Calls `f` on the optimizer hook, then on every other hook.
    fn call(
        &mut self,
        f: impl FnMut(&mut dyn Hook<B, M>, &mut TrainState<B, M>) -> Result<()>,
    ) -> Result<()> {
        self.hooks.call(&mut self.state, f)
    }

    fn save_if_requested(&mut self) -> Result<()> {
        if std::mem::take(&mut self.state.snapshot_due) {
            self.call(|hook, state| hook.before_snapshot(state))?;
        }
        if let Some(path) = self.state.save_request.take() {
            self.save_snapshot(&path)?;
            self.call(|hook, state| hook.after_save(state, &path))?;
        }
        Ok(())
    }

    /// Writes a snapshot of the run as it stands after the current iteration, to `path` and to
    /// `latest.ckpt` beside it.
    pub fn save_snapshot(&mut self, path: &Path) -> Result<()> {
        let mut whole = self.state.whole_optimizer.take();
        if whole.is_none() && !self.state.sharded_optimizer {
            // Called directly: a state held elsewhere than the optimizer (on the host, with
            // optimizer offload) is handed over by the hooks as before any snapshot.
            self.call(|hook, state| hook.before_snapshot(state))?;
            whole = self.state.whole_optimizer.take();
        }
        if whole.is_none() && self.state.sharded_optimizer {
            return Err(Error::snapshot(
                path,
                "the optimizer state is sharded across the data-parallel peers (zero_stage): a \
                 snapshot is written through the SnapshotHook, whose request has every peer \
                 gather it first",
            ));
        }
        let model = self.state.whole_model.take();
        let weights = self.state.whole_weights.take();
        // Serialising is not training: keep it out of the peak memory the log reports.
        crate::memory::without_peak(|| self.write_snapshot(path, model, whole, weights))
    }

    fn write_snapshot(
        &self,
        path: &Path,
        whole_model: Option<Vec<u8>>,
        whole_optimizer: Option<Vec<u8>>,
        whole_weights: Option<Vec<u8>>,
    ) -> Result<()> {
        let bad = |error| super::snapshot::bad_snapshot(path, error);
        let completed = (self.state.iter + 1).min(self.state.max_iters);
        let mut hooks = BTreeMap::new();
        for hook in self.hooks.iter() {
            if let Some(value) = hook.state_dict() {
                hooks.insert(hook.name().to_string(), value);
            }
        }
        let mut meta = SnapshotMeta {
            memsave_version: env!("CARGO_PKG_VERSION").to_string(),
            iter: completed,
            epoch: completed / self.state.iters_per_epoch,
            param_shapes: shapes::<B, M>(&self.state.model),
            precision: None,
            weights: self.state.weights.as_ref().map(|store| store.spec()),
            hooks,
        };
        for hook in self.hooks.iter() {
            hook.before_save(&mut meta);
        }
        let snapshot = Snapshot {
            meta,
            model: match whole_model {
                Some(bytes) => bytes,
                None => {
                    // Frozen weights held compressed: their dequantized values.
                    let frozen = self.context.part::<crate::nn::FrozenWeights>();
                    let model = crate::nn::frozen::expand(self.state.model.clone(), &frozen);
                    record_bytes::<B, _>(model.into_record()).map_err(bad)?
                }
            },
            optimizer: match whole_optimizer {
                Some(bytes) => bytes,
                None => self.state.optimizer.to_bytes().map_err(bad)?,
            },
            weights: match whole_weights {
                Some(bytes) => Some(bytes),
                None => self.state.weights.as_ref().map(|store| store.to_bytes()),
            },
        };
        snapshot.save(path)?;
        let latest = path.with_file_name("latest.ckpt");
        if latest != path {
            super::snapshot::link_or_copy(path, &latest, &snapshot)?;
        }
        Ok(())
    }

    /// Restores weights, optimizer state, hook states and position from a snapshot. Call it
    /// before [`Runner::run`].
    pub fn resume(&mut self, path: &Path) -> Result<()> {
        let checkpoint = Snapshot::load(path)?;
        let bad = |message: String| Error::snapshot(path, message);
        let expected = shapes::<B, M>(&self.state.model);
        if checkpoint.meta.param_shapes != expected {
            return Err(bad(format!(
                "it was saved from another model ({} parameters there, {} here, or other shapes)",
                checkpoint.meta.param_shapes.len(),
                expected.len()
            )));
        }
        if checkpoint.meta.iter > self.state.max_iters {
            return Err(bad(format!(
                "it is at iteration {}, past the end of this run ({} iterations)",
                checkpoint.meta.iter, self.state.max_iters
            )));
        }
        let damaged = |error| super::snapshot::bad_snapshot(path, error);
        let record =
            load_bytes::<B, M::Record>(&checkpoint.model, &self.state.device).map_err(damaged)?;
        self.state.model = self.state.model.clone().load_record(record);
        self.state.optimizer = self
            .state
            .optimizer
            .clone()
            .load_bytes(&checkpoint.optimizer, &self.state.device)
            .map_err(damaged)?;
        self.resume_weights(&checkpoint, path)?;
        let mut hook_states = checkpoint.meta.hooks.clone();
        for hook in self.hooks.iter_mut() {
            if let Some(value) = hook_states.remove(hook.name()) {
                hook.load_state_dict(value).map_err(|error| {
                    let message = match &error {
                        Error::InvalidValue { field, message } => {
                            format!("`hooks.{}.{field}`: {message}", hook.name())
                        }
                        other => format!("hook `{}`: {other}", hook.name()),
                    };
                    Error::Snapshot {
                        path: path.to_path_buf(),
                        message,
                        source: Some(error.into()),
                    }
                })?;
            }
        }
        self.state.iter = checkpoint.meta.iter;
        self.position();
        let meta = &checkpoint.meta;
        self.hooks.call(&mut self.state, |hook, state| {
            hook.after_load(state, meta, path)
        })
    }
}

impl<B, M, D> Runner<B, M, D>
where
    B: AutodiffBackend,
    M: TrainModel<B>,
    D: DataSource<B, M::Batch>,
{
    /// The 16-bit weights' store from a snapshot: restored where both keep the weights in 16
    /// bits; a change of type or rounding converts, with a notice naming both; a snapshot of
    /// 16-bit weights without its store is an error naming the file.
    fn resume_weights(&mut self, checkpoint: &Snapshot, path: &Path) -> Result<()> {
        let now = self.state.weights.as_ref().map(|store| store.spec());
        let saved = checkpoint.meta.weights;
        let describe = |spec: Option<super::weights::WeightSpec>| {
            spec.map_or_else(|| "fp32".to_string(), |spec| spec.describe())
        };
        let (now_text, saved_text) = (describe(now), describe(saved));
        let notice = match (self.state.weights.as_mut(), saved) {
            (Some(store), Some(saved)) => {
                let Some(bytes) = &checkpoint.weights else {
                    return Err(Error::snapshot(
                        path,
                        format!(
                            "its header says its weights are {saved_text}, but the weights' \
                             section (step count, Kahan compensation) is missing"
                        ),
                    ));
                };
                store
                    .load_bytes(bytes, saved, &self.state.device)
                    .map_err(|error| super::snapshot::bad_snapshot(path, error))?;
                let spec = store.spec();
                if spec.dtype != saved.dtype {
                    Some(format!(
                        "they load as saved and are rounded to nearest {}",
                        spec.dtype
                    ))
                } else if spec.rounding != saved.rounding {
                    Some(match (saved.rounding, spec.rounding) {
                        (super::weights::WeightRounding::Kahan, _) => {
                            "their Kahan compensation is dropped".to_string()
                        }
                        (_, super::weights::WeightRounding::Kahan) => {
                            "the Kahan compensation starts at zero".to_string()
                        }
                        _ => "the rounding changes from the next step".to_string(),
                    })
                } else {
                    None
                }
            }
            (Some(store), None) => Some(format!(
                "they are rounded to nearest {} as the run starts",
                store.spec().dtype
            )),
            (None, Some(_)) => Some("they load exactly as fp32".to_string()),
            (None, None) => None,
        };
        if let Some(notice) = notice {
            self.state.warn(format!(
                "checkpoint {} holds {saved_text} weights, and this config keeps them in \
                 {now_text}: {notice}; set `optimizer.weight_dtype` and `weight_rounding` as the \
                 run that wrote it did to resume it exactly",
                path.display()
            ));
        }
        Ok(())
    }
}

fn shapes<B: AutodiffBackend, M: TrainModel<B>>(model: &M) -> Vec<Vec<usize>> {
    param_shapes::<B, M>(model)
        .into_iter()
        .map(|(_, shape)| shape)
        .collect()
}
