//! The scheduler adapter: the user's scheduler stepped once per optimizer step. burn-train
//! 0.22 steps the learner's scheduler before each `optimize` when its own accumulation is off
//! (memsave's needs it off), that is on every micro-batch; within a group this holds the rate.
//!
//! Its record carries memsave's state through burn-train's checkpoints: burn-train 0.22 saves a
//! scheduler's record as named scalars beside the model's and the optimizer's (whose record
//! types are closed), so the loss scaler and the micro-batches seen are written there under
//! `memsave.`, beside the user's scheduler's own scalars, which stay where that scheduler reads
//! them (a checkpoint of memsave's loads into a run without it, and the other way round with a
//! warning).

use std::sync::{Arc, Mutex};

use burn::optim::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::LearningRate;

use super::{lock, Shared};
use crate::scaler::{LossScaler, ScaleMode};

const ITER: &str = "memsave.iter";
const SCALER: &str = "memsave.loss_scaler";
const SKIPPED: &str = "memsave.skipped_steps";
const RATE: &str = "memsave.lr";
const GROUPS: &str = "memsave.groups";

impl Shared {
    /// `record` with memsave's state: the micro-batches the optimizer has seen and, under mixed
    /// precision, the loss scaler's whole state.
    pub(crate) fn save_state(&self, record: LrSchedulerRecord) -> LrSchedulerRecord {
        let mut record = record
            .with_scalar(ITER, self.iter as u64)
            .with_scalar(SKIPPED, self.skipped_steps as u64);
        if let Some(mixed) = &self.mixed {
            let state = serde_json::to_value(&mixed.scaler).expect("a scaler serialises");
            let key = |field: &str| format!("{SCALER}.{field}");
            for (field, value) in state.as_object().into_iter().flatten() {
                record = match value {
                    serde_json::Value::String(mode) => {
                        record.with_scalar(&key("dynamic"), mode == "dynamic")
                    }
                    serde_json::Value::Number(n) if n.is_u64() => {
                        record.with_scalar(&key(field), n.as_u64().expect("a u64"))
                    }
                    serde_json::Value::Number(n) if n.is_i64() => {
                        record.with_scalar(&key(field), n.as_i64().expect("an i64"))
                    }
                    serde_json::Value::Number(n) => {
                        record.with_scalar(&key(field), n.as_f64().expect("a number"))
                    }
                    _ => record,
                };
            }
        }
        record
    }

    /// Restores [`Shared::save_state`]'s state; what a checkpoint lacks (one written without
    /// memsave, or without mixed precision) starts afresh, with a warning saying so.
    pub(crate) fn load_state(&mut self, record: &LrSchedulerRecord) {
        let Some(iter) = record.scalar::<u64>(ITER) else {
            self.warn(
                "the checkpoint holds no memsave state (it was written without memsave's \
                 adapter): the loss scaler and the count of micro-batches start afresh"
                    .to_string(),
            );
            return;
        };
        if self.mixed.is_some() {
            match scaler_from(record) {
                Some(Ok(scaler)) => self.mixed.as_mut().expect("checked").scaler = scaler,
                Some(Err(error)) => self.warn(format!(
                    "the checkpoint's loss scaler does not load ({error}): it starts afresh at \
                     its init_scale"
                )),
                None => self.warn(
                    "the checkpoint was trained without mixed precision: the loss scaler starts \
                     afresh at its init_scale"
                        .to_string(),
                ),
            }
        }
        let iter = iter as usize;
        let cumulative = self.groups().cumulative_iters();
        if !iter.is_multiple_of(cumulative) {
            self.warn(format!(
                "resuming at micro-batch {iter}, which is not a multiple of cumulative_iters \
                 ({cumulative}): the gradients of the first {} micro-batches of this group are \
                 lost, which may change the result slightly",
                iter % cumulative
            ));
        }
        self.iter = iter;
        self.forwards = iter;
        self.skipped_steps = record.scalar::<u64>(SKIPPED).unwrap_or(0) as usize;
        self.summed = None;
    }
}

/// The loss scaler in `record`, checked as a configured one is; `None` where it holds none.
fn scaler_from(record: &LrSchedulerRecord) -> Option<crate::Result<LossScaler>> {
    let key = |field: &str| format!("{SCALER}.{field}");
    let dynamic = record.scalar::<bool>(&key("dynamic"))?;
    let mode = if dynamic {
        ScaleMode::Dynamic
    } else {
        ScaleMode::Static
    };
    let float = |field: &str| record.scalar::<f64>(&key(field));
    let state = serde_json::json!({
        "cur_scale": float("cur_scale"),
        "mode": mode,
        "scale_factor": float("scale_factor"),
        "backoff_factor": float("backoff_factor"),
        "scale_window": record.scalar::<u64>(&key("scale_window")),
        "cur_iter": record.scalar::<u64>(&key("cur_iter")),
        "last_overflow_iter": record.scalar::<i64>(&key("last_overflow_iter")),
    });
    Some(LossScaler::from_state(state))
}

/// The user's scheduler, stepped at the first micro-batch of each group (see the
/// [module docs](super)). Its record is the inner scheduler's and memsave's state.
///
/// It takes what burn-train's `Learner::new` takes (a rate, a scheduler, the `ModuleLrScheduler`
/// Burn's scheduler configs' `init()` make); every parameter group's rate reaches the optimizer's
/// step.
#[derive(Clone)]
pub struct MemsaveScheduler {
    inner: ModuleLrScheduler,
    shared: Arc<Mutex<Shared>>,
    /// The rate of the current group.
    current: Option<LearningRate>,
}

impl MemsaveScheduler {
    pub(crate) fn new(inner: impl Into<ModuleLrScheduler>, shared: Arc<Mutex<Shared>>) -> Self {
        MemsaveScheduler {
            inner: inner.into(),
            shared,
            current: None,
        }
    }

    /// The user's scheduler.
    pub fn inner(&self) -> &ModuleLrScheduler {
        &self.inner
    }
}

impl LrScheduler for MemsaveScheduler {
    fn step(&mut self) -> LearningRate {
        // burn-train steps the scheduler just before the optimizer sees micro-batch `iter`.
        let (iter, cumulative) = {
            let shared = lock(&self.shared);
            (shared.iter, shared.groups().cumulative_iters())
        };
        match self.current {
            Some(rate) if !iter.is_multiple_of(cumulative) => rate,
            _ => {
                let rates = self.inner.step();
                let rate = rates.base();
                // Every group's rate, for the optimizer's step (`MemsaveModel::optimize`).
                lock(&self.shared).lr = Some(rates);
                self.current = Some(rate);
                rate
            }
        }
    }

    /// The user's scheduler's record as a plain run writes it (its base group's scalars where
    /// that scheduler reads them; the whole record under `memsave.groups`), the current group's
    /// rate, and memsave's state.
    fn to_record(&self) -> LrSchedulerRecord {
        let inner = self.inner.to_record();
        // The base group's scalars where a plain run writes them; the whole record (every group,
        // a group without state included) under `memsave.groups` for memsave's own resume.
        let mut record = inner.record("0").with_record(GROUPS, inner);
        if let Some(rate) = self.current {
            record = record.with_scalar(RATE, rate);
        }
        lock(&self.shared).save_state(record)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        let ours = record.record(GROUPS);
        let inner = match ours.is_empty() {
            false => ours,
            // A plain run's checkpoint: its scheduler's scalars are the base group's.
            true => LrSchedulerRecord::new().with_record("0", record.clone()),
        };
        self.inner = self.inner.clone().load_record(inner);
        let mut shared = lock(&self.shared);
        shared.load_state(&record);
        // Resumed inside a group: the group's rate as it was (the user's scheduler stepped at
        // its first micro-batch, before the checkpoint).
        self.current = record.scalar::<f64>(RATE);
        shared.lr = self.current.map(ModuleLearningRate::from);
    }
}
