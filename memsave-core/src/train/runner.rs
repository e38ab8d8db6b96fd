//! The training loop (MMCV's `EpochBasedRunner` / `IterBasedRunner`). The loop owns the order of
//! things; hooks own the policies: the optimizer hook (precision, accumulation, clipping), the
//! learning-rate schedule, snapshots, logging. A new strategy is a new hook, never an `if`
//! here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;

use super::optim::{Optim, OptimizerKind};
use super::params::{param_bytes, param_shapes};
use super::snapshot::codec::{load_bytes, record_bytes};
use super::snapshot::{Snapshot, SnapshotMeta};
use super::state::{DataSource, IterLog, TrainModel, TrainState};
use crate::{Error, Result};

/// A policy that acts at the runner's hook points.
pub trait Hook<B: AutodiffBackend, M: TrainModel<B>> {
    /// The name its state is saved under in snapshots.
    fn name(&self) -> &'static str;

    /// Once, before the first iteration (after a resume).
    fn before_run(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// At the start of each epoch.
    fn before_epoch(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// Before each iteration's forward.
    fn before_iter(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// After each iteration's forward (`state.loss` is set).
    fn after_iter(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// At the end of each epoch.
    fn after_epoch(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// Once, after the last iteration.
    fn after_run(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        Ok(())
    }

    /// State to keep in snapshots.
    fn state_dict(&self) -> Option<serde_json::Value> {
        None
    }

    /// Restores the state from a snapshot.
    fn load_state_dict(&mut self, _value: serde_json::Value) -> Result<()> {
        Ok(())
    }

    /// After the runner wrote a snapshot to `path` (whole, renamed into place).
    fn after_save(&mut self, _state: &mut TrainState<B, M>, _path: &Path) -> Result<()> {
        Ok(())
    }

    /// What to add to the advice when a step ran out of device memory (the planner says what
    /// its profile predicts would fit the memory the device held).
    fn out_of_memory_advice(&self, _state: &TrainState<B, M>) -> Option<String> {
        None
    }

    /// The precision the model trains in, for the optimizer hook (`"fp32"`, `"f16"`, `"bf16"`):
    /// written in snapshots, compared on resume.
    fn precision(&self) -> Option<String> {
        None
    }
}

/// How long a run is (MMCV's `runner = dict(type='EpochBasedRunner', max_epochs=12)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "RunnerFields")]
pub enum RunLength {
    /// `max_epochs` passes over the data (MMCV's `EpochBasedRunner`).
    Epochs(usize),
    /// `max_iters` iterations (MMCV's `IterBasedRunner`).
    Iters(usize),
}

/// [`RunLength`] as written.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RunnerFields {
    #[serde(rename = "type")]
    kind: RunnerType,
    #[serde(default)]
    max_epochs: Option<usize>,
    #[serde(default)]
    max_iters: Option<usize>,
}

#[derive(serde::Deserialize)]
enum RunnerType {
    EpochBasedRunner,
    IterBasedRunner,
}

impl TryFrom<RunnerFields> for RunLength {
    type Error = Error;

    fn try_from(fields: RunnerFields) -> Result<Self> {
        match (fields.kind, fields.max_epochs, fields.max_iters) {
            (RunnerType::EpochBasedRunner, Some(epochs), None) if epochs > 0 => {
                Ok(RunLength::Epochs(epochs))
            }
            (RunnerType::IterBasedRunner, None, Some(iters)) if iters > 0 => {
                Ok(RunLength::Iters(iters))
            }
            (RunnerType::EpochBasedRunner, _, _) => Err(Error::invalid(
                "max_epochs",
                "an EpochBasedRunner needs `max_epochs` (a positive integer) and no `max_iters`",
            )),
            (RunnerType::IterBasedRunner, _, _) => Err(Error::invalid(
                "max_iters",
                "an IterBasedRunner needs `max_iters` (a positive integer) and no `max_epochs`",
            )),
        }
    }
}

impl RunLength {
    /// Whether the run counts epochs.
    pub fn by_epoch(self) -> bool {
        matches!(self, RunLength::Epochs(_))
    }
}

/// The training loop.
pub struct Runner<B: AutodiffBackend, M: TrainModel<B>, D: DataSource<M::Batch>> {
    state: TrainState<B, M>,
    data: D,
    optimizer_hook: Box<dyn Hook<B, M>>,
    hooks: Vec<Box<dyn Hook<B, M>>>,
}

impl<B, M, D> Runner<B, M, D>
where
    B: AutodiffBackend,
    M: TrainModel<B>,
    D: DataSource<M::Batch>,
{
    /// A runner for `model` on `data`; `optimizer_hook` does the backward pass and the step.
    pub fn new(
        model: M,
        optimizer: &OptimizerKind,
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
        let mut state = TrainState::new(model, Optim::new(optimizer), device, work_dir.into());
        state.optimizer_state_copies = optimizer.state_copies();
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
        Ok(Runner {
            state,
            data,
            optimizer_hook,
            hooks: Vec::new(),
        })
    }

    /// Makes this runner one peer of a data-parallel run (see [`crate::dist`]): it starts from
    /// rank 0's weights, the optimizer hook averages the gradients over the peers, and only rank
    /// 0 writes checkpoints. The data source must read this peer's shard
    /// ([`crate::dist::Collective::shard`]).
    pub fn set_collective(&mut self, collective: crate::dist::SharedCollective<B::InnerBackend>) {
        self.state.collective = Some(collective);
    }

    /// Adds a hook; hooks run in the order they were added, after the optimizer hook.
    pub fn register_hook(&mut self, hook: Box<dyn Hook<B, M>>) {
        self.hooks.push(hook);
    }

    /// The run's state.
    pub fn state(&self) -> &TrainState<B, M> {
        &self.state
    }

    /// The trained weights.
    pub fn into_model(self) -> M {
        self.state.model
    }

    /// Runs from `state.iter` to the end.
    ///
    /// First it checks that what one step needs and that is known up front (the batch, the
    /// gradients, the optimizer state) fits in the memory available, so that a run that cannot
    /// fit ends with an error before it writes anything; a device allocator's out-of-memory
    /// failure during a step (CUDA) also ends the run with that error, not a panic. Checkpoints
    /// already written are left as they are.
    pub fn run(&mut self) -> Result<()> {
        self.preflight()?;
        self.position();
        if let Some(collective) = self.state.collective.clone() {
            // Every peer starts from rank 0's weights (after a resume too).
            self.state.model =
                crate::dist::broadcast_module::<B, M>(&*collective, self.state.model.clone())?;
        }
        self.call(|hook, state| hook.before_run(state))?;
        while self.state.iter < self.state.max_iters {
            let (epoch, index) = (self.state.epoch, self.state.inner_iter);
            if index == 0 {
                self.call(|hook, state| hook.before_epoch(state))?;
            }
            self.state.log = IterLog::default();
            self.call(|hook, state| hook.before_iter(state))?;

            let batch = self.data.batch(epoch, index)?;
            self.step(batch)?;
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

    /// Forward, then the hooks' backward and optimizer step; a device's out-of-memory panic
    /// becomes [`Error::OutOfMemory`].
    fn step(&mut self, batch: M::Batch) -> Result<()> {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (loss, parts) = crate::memory::scope(crate::memory::phase::FORWARD, || {
                self.state.forward_model().loss_with_parts(batch)
            });
            crate::checkpoint::profile::boundary(crate::checkpoint::profile::Boundary::ForwardEnd);
            self.state.log.parts = parts
                .iter()
                .map(|(name, part)| (*name, super::grads::scalar(part)))
                .collect();
            self.state.loss = Some(loss);
            self.call(|hook, state| hook.after_iter(state))
        }));
        match outcome {
            Ok(result) => result,
            Err(payload) => {
                let message = panic_text(payload.as_ref());
                if !crate::memory::is_out_of_memory_panic(&message) {
                    std::panic::resume_unwind(payload);
                }
                self.state.loss = None;
                let needed = crate::memory::out_of_memory_size(&message).unwrap_or(0);
                let (place, _) = crate::memory::device_available_bytes(&self.state.device);
                let mut advice = memory_advice(self.data.footprint().map(|f| f.smaller), true);
                for hook in std::iter::once(&self.optimizer_hook).chain(&self.hooks) {
                    if let Some(more) = hook.out_of_memory_advice(&self.state) {
                        advice = format!("{advice}; {more}");
                    }
                }
                Err(Error::OutOfMemory {
                    what: format!(
                        "iteration {} (a buffer the device allocator could not find room for)",
                        self.state.iter
                    ),
                    needed,
                    place,
                    available: None,
                    advice,
                })
            }
        }
    }

    /// The sizes known before the first step, against the memory available.
    fn preflight(&self) -> Result<()> {
        let (place, available) = crate::memory::device_available_bytes(&self.state.device);
        let (Some(available), Some(batch)) = (available, self.data.footprint()) else {
            return Ok(());
        };
        let (_, trainable) = param_bytes::<B, M>(&self.state.model);
        // Gradients, and the optimizer state once it exists (the first step makes it).
        let states = trainable * (1 + self.state.optimizer_state_copies);
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
            advice: memory_advice(Some(batch.smaller), batch.bytes <= available),
        })
    }

    /// Epoch and position in it, from `iter`.
    fn position(&mut self) {
        self.state.epoch = self.state.iter / self.state.iters_per_epoch;
        self.state.inner_iter = self.state.iter % self.state.iters_per_epoch;
    }

    /// Calls `f` on the optimizer hook, then on every other hook.
    fn call(
        &mut self,
        mut f: impl FnMut(&mut dyn Hook<B, M>, &mut TrainState<B, M>) -> Result<()>,
    ) -> Result<()> {
        f(&mut *self.optimizer_hook, &mut self.state)?;
        for hook in &mut self.hooks {
            f(&mut **hook, &mut self.state)?;
        }
        Ok(())
    }

    fn save_if_requested(&mut self) -> Result<()> {
        if let Some(path) = self.state.save_request.take() {
            if !self.state.is_main() {
                // Rank 0 writes the checkpoints of a data-parallel run.
                return Ok(());
            }
            self.save_snapshot(&path)?;
            self.call(|hook, state| hook.after_save(state, &path))?;
        }
        Ok(())
    }

    /// Writes a snapshot of the run as it stands after the current iteration, to `path` and to
    /// `latest.ckpt` beside it.
    pub fn save_snapshot(&mut self, path: &Path) -> Result<()> {
        // Serialising is not training: keep it out of the peak memory the log reports.
        crate::memory::without_peak(|| self.write_snapshot(path))
    }

    fn write_snapshot(&self, path: &Path) -> Result<()> {
        let bad = |error: super::snapshot::codec::CodecError| Error::Snapshot {
            path: path.to_path_buf(),
            message: error.to_string(),
        };
        let completed = (self.state.iter + 1).min(self.state.max_iters);
        let mut hooks = BTreeMap::new();
        for hook in std::iter::once(&self.optimizer_hook).chain(&self.hooks) {
            if let Some(value) = hook.state_dict() {
                hooks.insert(hook.name().to_string(), value);
            }
        }
        let snapshot = Snapshot {
            meta: SnapshotMeta {
                memsave_version: env!("CARGO_PKG_VERSION").to_string(),
                iter: completed,
                epoch: completed / self.state.iters_per_epoch,
                param_shapes: shapes::<B, M>(&self.state.model),
                precision: self.optimizer_hook.precision(),
                hooks,
            },
            model: record_bytes::<B, _>(self.state.model.clone().into_record()).map_err(bad)?,
            optimizer: self.state.optimizer.to_bytes().map_err(bad)?,
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
        let bad = |message: String| Error::Snapshot {
            path: path.to_path_buf(),
            message,
        };
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
        let record = load_bytes::<B, M::Record>(&checkpoint.model, &self.state.device)
            .map_err(|error| bad(error.to_string()))?;
        if let (Some(saved), Some(now)) =
            (&checkpoint.meta.precision, self.optimizer_hook.precision())
        {
            if *saved != now {
                let scaler = if now == "fp32" {
                    "its loss scaler is dropped"
                } else if saved == "fp32" {
                    "the loss scaler starts afresh at its `init_scale`"
                } else {
                    "the loss scaler carries on"
                };
                self.state.warn(format!(
                    "checkpoint {} was trained in {saved}, and this config trains in {now}: the \
                     weights load (they are kept in fp32), {scaler}; set `[fp16]` as the run that \
                     wrote it did to resume it exactly",
                    path.display()
                ));
            }
        }
        self.state.model = self.state.model.clone().load_record(record);
        self.state.optimizer = self
            .state
            .optimizer
            .clone()
            .load_bytes(&checkpoint.optimizer, &self.state.device)
            .map_err(|error| bad(error.to_string()))?;
        let mut hook_states = checkpoint.meta.hooks;
        for hook in std::iter::once(&mut self.optimizer_hook).chain(&mut self.hooks) {
            if let Some(value) = hook_states.remove(hook.name()) {
                hook.load_state_dict(value).map_err(|error| match error {
                    Error::InvalidValue { field, message } => {
                        bad(format!("`hooks.{}.{field}`: {message}", hook.name()))
                    }
                    other => bad(format!("hook `{}`: {other}", hook.name())),
                })?;
            }
        }
        self.state.iter = checkpoint.meta.iter;
        self.position();
        Ok(())
    }
}

/// What to change when a step does not fit; strategies only where they can help.
fn memory_advice(smaller: Option<String>, strategies: bool) -> String {
    let smaller = smaller.unwrap_or_else(|| "make the batch or the images smaller".to_string());
    if strategies {
        format!(
            "{smaller}, or save memory with a strategy: mixed precision (`[fp16]`), gradient \
             accumulation over smaller batches (`optimizer_config.cumulative_iters`), gradient \
             checkpointing (`with_cp = true`); `memsave plan CONFIG --budget SIZE` measures \
             which combination fits SIZE at the least cost, and `with_cp = \"auto\"` with \
             `[memory] memory_budget = SIZE` checkpoints only the blocks that SIZE needs"
        )
    } else {
        format!("{smaller} (no strategy makes the input batch itself smaller)")
    }
}

/// The text of a panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        String::new()
    }
}

fn shapes<B: AutodiffBackend, M: TrainModel<B>>(model: &M) -> Vec<Vec<usize>> {
    param_shapes::<B, M>(model)
        .into_iter()
        .map(|(_, shape)| shape)
        .collect()
}
