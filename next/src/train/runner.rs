//! The training loop on Burn 0.22 (MMCV's `EpochBasedRunner` / `IterBasedRunner`). The loop
//! owns the order of things; hooks own the policies: the optimizer hook (precision,
//! accumulation, clipping), the learning-rate schedule, snapshots, logging. A new strategy is a
//! new hook, never an `if` here.

use std::path::{Path, PathBuf};

use burn::optim::ModuleOptimizer;
use burn::prelude::*;

use super::hook::{Hook, Hooks, Priority};
use super::state::{DataSource, IterLog, TrainModel, TrainState};
use super::RunLength;
use crate::hooks::LrUpdaterHook;
use crate::memory::{in_phase, phase};
use crate::snapshot::Snapshot;
use crate::{Error, Result, RunContext};

/// The error of a run that no hook gave a learning rate.
fn no_learning_rate() -> Error {
    Error::invalid(
        "lr",
        "no learning rate was set, so the run would train at 0: call `Runner::set_lr(0.01)` \
         for a constant rate, register an `LrUpdaterHook` with a schedule \
         (`LrUpdaterHook::new(LrSchedule { base_lr: 0.01, ..Default::default() })`), or set \
         `state.lr` in a hook's `before_iter`",
    )
}

/// The training loop.
pub struct Runner<M: TrainModel, D: DataSource<M::Batch>> {
    state: TrainState<M>,
    data: D,
    hooks: Hooks<M>,
    /// The run's context: the one installed on the thread that made the runner, or that
    /// thread's own.
    context: RunContext,
}

impl<M: TrainModel, D: DataSource<M::Batch>> Runner<M, D> {
    /// A runner for `model` on `data`, stepped by `optimizer` (Burn's `AdamWConfig::new().init()`,
    /// memsave's `Adam8`, `Weights16`, ...); `optimizer_hook` does the backward pass and the step
    /// (at [`Priority::AboveNormal`], MMCV's). `device` is where the batches are made (an
    /// autodiff device).
    pub fn new(
        model: M,
        optimizer: ModuleOptimizer,
        optimizer_hook: Box<dyn Hook<M>>,
        data: D,
        length: RunLength,
        work_dir: impl Into<PathBuf>,
        device: Device,
    ) -> Result<Self> {
        let iters_per_epoch = data.batches_per_epoch();
        if iters_per_epoch == 0 {
            return Err(Error::Data("the data set yields no batch".into()));
        }
        let mut state = TrainState::new(model, optimizer, device, work_dir.into());
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

    /// The run's context: its settings and figures. Made where the runner was, or given with
    /// [`Runner::with_context`].
    pub fn context(&self) -> &RunContext {
        &self.context
    }

    /// Runs in `context` rather than in the run installed where the runner was made.
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
    pub fn register_hook(&mut self, hook: Box<dyn Hook<M>>) {
        self.register_hook_at(hook, Priority::Normal);
    }

    /// Adds a hook that runs after every hook of a priority above or equal to `priority`
    /// and before the others (MMCV's `register_hook(hook, priority)`).
    pub fn register_hook_at(&mut self, hook: Box<dyn Hook<M>>, priority: Priority) {
        self.hooks.insert(hook, priority);
    }

    /// The run's state.
    pub fn state(&self) -> &TrainState<M> {
        &self.state
    }

    /// The run's state, to set up before [`Runner::run`].
    pub fn state_mut(&mut self) -> &mut TrainState<M> {
        &mut self.state
    }

    /// The trained weights.
    pub fn into_model(self) -> M {
        self.state.model
    }

    /// Runs from `state.iter` to the end, in the run's context. A hook's error, a failure a
    /// segment recorded in the run, or a first step whose `with_cp` switches ran no segment end
    /// the run with that error; snapshots already written are left as they are.
    pub fn run(&mut self) -> Result<()> {
        let context = self.context.clone();
        let _entered = context.enter()?;
        let outcome = self.run_here();
        if outcome.is_err() {
            self.hooks
                .call(&mut self.state, |hook, state| {
                    hook.after_failure(state);
                    Ok(())
                })
                .expect("after_failure returns nothing to fail");
        }
        outcome
    }

    fn run_here(&mut self) -> Result<()> {
        self.position();
        self.call(|hook, state| hook.before_run(state))?;
        let mut first_step = true;
        while self.state.iter < self.state.max_iters {
            let (epoch, index) = (self.state.epoch, self.state.inner_iter);
            if index == 0 {
                self.call(|hook, state| hook.before_epoch(state))?;
            }
            self.state.log = IterLog::default();
            (self.state.forward_passes, self.state.pass) = (1, 0);
            self.call(|hook, state| hook.before_iter(state))?;
            if self.state.lr.is_nan() {
                return Err(no_learning_rate());
            }
            self.step(epoch, index)
                .map_err(|error| error.in_step(self.state.iter, &self.state.work_dir))?;
            if std::mem::take(&mut first_step) {
                self.check_segments_ran()?;
            }
            self.save_if_requested()?;
            if index + 1 == self.state.iters_per_epoch {
                self.call(|hook, state| hook.after_epoch(state))?;
                self.save_if_requested()?;
            }
            self.state.iter += 1;
            self.position();
        }
        self.call(|hook, state| hook.after_run(state))?;
        self.save_if_requested()
    }

    /// The forward of batch `index` of `epoch` (the loss for the hooks, its parts for the log),
    /// then the hooks' backward and optimizer step; twice where a hook asked for two passes
    /// ([`TrainState::forward_passes`]): the second forward on the same batch, with the same
    /// random draws (the iteration's forward draws from a seed the runner takes from the
    /// device's stream, given again before the second) and the running statistics as they were
    /// before the first. A failure a segment recorded in the run ends the step.
    fn step(&mut self, epoch: usize, index: usize) -> Result<()> {
        // A failure recorded outside a step (a segment run without the runner) is not this
        // step's.
        let _ = crate::run::take_failure();
        let batch = self.data.batch(epoch, index, &self.state.device)?;
        let device = self.state.device.clone();
        let seed = crate::checkpoint::state::draw_seed(&device);
        device.seed(seed);
        if self.state.forward_passes < 2 {
            self.forward(batch)?;
            return self.after_forward();
        }
        let running = crate::checkpoint::state::Running::save(self.state.forward_model());
        self.forward(batch)?;
        self.call(|hook, state| hook.after_first_pass(state))?;
        self.fail_if_recorded()?;
        if self.state.forward_passes < 2 {
            // A hook gave the second pass up (an overflow): the iteration ends here.
            return self.after_forward();
        }
        self.state.pass = 1;
        let batch = self.data.batch(epoch, index, &self.state.device)?;
        if let Some(running) = running {
            running.restore(self.state.forward_model());
        }
        device.seed(seed);
        self.forward(batch)?;
        self.after_forward()
    }

    /// The hooks' `before_forward`, then the forward of `batch`.
    fn forward(&mut self, batch: M::Batch) -> Result<()> {
        self.call(|hook, state| hook.before_forward(state))?;
        let (loss, parts) = in_phase(phase::FORWARD, || {
            self.state.forward_model().loss_with_parts(batch)
        });
        self.fail_if_recorded()?;
        self.state.log.parts = parts
            .iter()
            .map(|(name, part)| (*name, super::scalar(part)))
            .collect();
        self.state.loss = Some(loss);
        Ok(())
    }

    /// The hooks' `after_iter` (the backward and the step), then any failure recorded.
    fn after_forward(&mut self) -> Result<()> {
        self.call(|hook, state| hook.after_iter(state))?;
        self.fail_if_recorded()
    }

    /// A failure a segment recorded in the run, as the step's error.
    fn fail_if_recorded(&self) -> Result<()> {
        match crate::run::take_failure() {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }

    /// After the first step: every module whose `with_cp` is on ran a `#[with_cp]` method.
    fn check_segments_ran(&mut self) -> Result<()> {
        let unused = memsave_common::checkpoint::unused_with_cp();
        if let Some(warning) = crate::check::segments_ran(&self.state.model, unused)? {
            self.state.warn(warning);
        }
        Ok(())
    }

    /// Epoch and position in it, from `iter`.
    fn position(&mut self) {
        self.state.epoch = self.state.iter / self.state.iters_per_epoch;
        self.state.inner_iter = self.state.iter % self.state.iters_per_epoch;
    }

    /// Calls `f` on every hook, in order.
    fn call(
        &mut self,
        f: impl FnMut(&mut dyn Hook<M>, &mut TrainState<M>) -> Result<()>,
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

    /// Writes a snapshot of the run as it stands after the current iteration (the model, the
    /// optimizer's state, every hook's state) to `path` and to `latest.ckpt` beside it, each
    /// whole or not at all.
    pub fn save_snapshot(&mut self, path: &Path) -> Result<()> {
        let completed = (self.state.iter + 1).min(self.state.max_iters);
        let held = self
            .hooks
            .iter()
            .find_map(|hook| hook.snapshot_model(&self.state));
        let mut snapshot = Snapshot::new(completed, completed / self.state.iters_per_epoch)
            .with_model(held.as_ref().unwrap_or(&self.state.model))?
            .with_optimizer(&self.state.optimizer)?;
        for hook in self.hooks.iter() {
            if let Some(value) = hook.state_dict() {
                snapshot = snapshot.with_hook(hook.name(), &value)?;
            }
        }
        for hook in self.hooks.iter() {
            hook.before_save(&mut snapshot.meta);
        }
        crate::memory::without_peak(|| {
            snapshot.save(path)?;
            let latest = path.with_file_name("latest.ckpt");
            if latest != path {
                snapshot.save(&latest)?;
            }
            Ok(())
        })
    }

    /// Restores weights, optimizer state, hook states and position from a snapshot written by
    /// [`Runner::save_snapshot`] (or by a user with `memsave_next::snapshot`). Call it before
    /// [`Runner::run`]. Another model's snapshot, a damaged one, one written by memsave on Burn
    /// 0.21 or past this run's end: an error naming the file.
    pub fn resume(&mut self, path: &Path) -> Result<()> {
        let snapshot = Snapshot::load(path)?;
        if snapshot.meta.iter > self.state.max_iters {
            return Err(Error::snapshot(
                path,
                format!(
                    "it is at iteration {}, past the end of this run ({} iterations)",
                    snapshot.meta.iter, self.state.max_iters
                ),
            ));
        }
        let (model, optimizer) =
            snapshot.restore(self.state.model.clone(), self.state.optimizer.clone())?;
        self.state.model = model;
        self.state.optimizer = optimizer;
        for hook in self.hooks.iter_mut() {
            let Some(value) = snapshot.hook(hook.name()).cloned() else {
                continue;
            };
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
        self.state.iter = snapshot.meta.iter;
        self.position();
        let meta = &snapshot.meta;
        self.hooks.call(&mut self.state, |hook, state| {
            hook.after_load(state, meta, path)
        })
    }
}
