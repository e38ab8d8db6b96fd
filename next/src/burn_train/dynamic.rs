//! `"dynamic"` in burn-train's Learner ([`Memsave::dynamic`], [`Memsave::dynamic_learner`]):
//! memsave-common's engine, its recording begun in `TrainStep::step` and ended after `optimize`.

use std::any::Any;
use std::collections::HashMap;

use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;
use burn::train::{InferenceStep, Learner};
use memsave_common::planner::no_staging;

use super::{lock, ForwardStep, LossOutput, Memsave, MemsaveModel};
use crate::checkpoint::{CheckpointModule, SegmentId};
use crate::fp16::Fp16Module;
use crate::planner::{Budget, DynamicMemory, IntervalFigures, ModelKeys, StepEnd};
use crate::{Error, Result};

/// `"dynamic"` in the Learner: the engine, the device it meters, and how the model's segments
/// are found (the learner [`Memsave::dynamic_learner`] makes knows its model's type).
pub(crate) struct DynamicRun {
    pub(crate) engine: DynamicMemory,
    pub(crate) device: Device,
    /// Whether the engine was started, on burn-train's training thread.
    pub(crate) started: bool,
    /// Micro-batches stepped under it.
    pub(crate) steps: usize,
    /// The segments of a model the forward runs on, to their paths.
    #[allow(clippy::type_complexity)]
    pub(crate) segments:
        Option<Box<dyn Fn(&dyn std::any::Any) -> Option<HashMap<SegmentId, String>> + Send>>,
}

/// The words of the Learner in `"dynamic"`'s advice.
const LEARNER_KEYS: ModelKeys = ModelKeys {
    with_cp: "the model's `with_cp` switches",
    batch: "the data loader's batch size",
    also_with_cp: &[],
};

impl Memsave {
    /// `with_cp = "dynamic"` in the Learner: a memory budget kept in every micro-batch's step at
    /// any input size, exactly, on `device` (memsave-common's engine, as in memsave's runner and
    /// `memsave_next::planner::Dynamic`): the first micro-batch is profiled with every segment
    /// checkpointed, and from then on each segment chooses at its entry whether to keep its
    /// activations. Build the learner with [`Memsave::dynamic_learner`]. Errors where the
    /// device's memory cannot be read (on the CPU, memsave's counting allocator must be the
    /// program's global allocator). A budget share is of the first micro-batch's peak.
    pub fn dynamic(self, budget: Budget, device: &Device) -> Result<Self> {
        let meter = crate::planner::meter(device)?;
        lock(&self.shared).dynamic = Some(DynamicRun {
            engine: DynamicMemory::new(budget, LEARNER_KEYS, meter, no_staging()),
            device: device.clone(),
            started: false,
            steps: 0,
            segments: None,
        });
        Ok(self)
    }

    /// [`Memsave::learner`] for [`Memsave::dynamic`]: every segment of `model` switched on (the
    /// engine chooses at each entry), its segments known to the engine. Errors where
    /// `Memsave::dynamic` was not called.
    pub fn dynamic_learner<M>(
        &self,
        model: M,
        optimizer: ModuleOptimizer,
        scheduler: impl Into<ModuleLrScheduler>,
    ) -> Result<Learner<MemsaveModel<M>>>
    where
        M: ForwardStep
            + InferenceStep
            + Module
            + Fp16Module
            + CheckpointModule
            + std::fmt::Display
            + 'static,
        <M as ForwardStep>::Output: LossOutput,
    {
        {
            let mut shared = lock(&self.shared);
            let Some(dynamic) = shared.dynamic.as_mut() else {
                return Err(Error::invalid(
                    "dynamic",
                    "`Memsave::dynamic_learner` keeps the budget `Memsave::dynamic(budget, \
                     &device)` gives: call it first",
                ));
            };
            dynamic.segments = Some(Box::new(|model: &dyn std::any::Any| {
                model.downcast_ref::<M>().map(crate::planner::segment_ids)
            }));
        }
        let model = crate::checkpoint::set_with_cp(model, true);
        Ok(Learner::new(
            self.model(model)?,
            optimizer,
            self.scheduler(scheduler),
        ))
    }

    /// `"dynamic"`'s figures so far: steps, segments kept and recomputed, the highest step peak
    /// and the budget in bytes, per input size (`None` without [`Memsave::dynamic`]).
    pub fn dynamic_figures(&self) -> Option<IntervalFigures> {
        lock(&self.shared)
            .dynamic
            .as_ref()
            .map(|dynamic| dynamic.engine.figures())
    }
}

impl<M> MemsaveModel<M>
where
    M: ForwardStep + Module + Fp16Module + 'static,
    M::Output: LossOutput,
{
    /// `"dynamic"` ([`super::Memsave::dynamic`]): the step's recording begun, every segment of
    /// `forward` (the model the forward runs on) choosing at its entry from then on.
    pub(super) fn begin_dynamic(&self, forward: &M) -> Result<()> {
        let mut shared = lock(&self.shared);
        let Some(dynamic) = shared.dynamic.as_mut() else {
            return Ok(());
        };
        let Some(paths) = dynamic
            .segments
            .as_ref()
            .and_then(|segments| segments(forward as &dyn Any))
        else {
            return Err(Error::invalid(
                "dynamic",
                "`Memsave::dynamic` chooses among the model's checkpointed segments, which only \
                 the learner `Memsave::dynamic_learner` makes knows: build the learner with it",
            ));
        };
        if !dynamic.started {
            // On burn-train's training thread, in the run: its segments ask the engine.
            dynamic.engine.start(None);
            dynamic.started = true;
        }
        let meter = crate::memory::peer_meter_for(&dynamic.device);
        dynamic.engine.begin_step(meter, paths);
        Ok(())
    }

    /// `"dynamic"` after a micro-batch's optimize: the step's peak against the budget, a new
    /// profile where its size was far from the others, the figures; an error (the least a step
    /// takes over the budget) stops the training.
    pub(super) fn end_dynamic(&self) {
        let context = lock(&self.shared)
            .context
            .get_or_insert_with(memsave_common::run::current)
            .clone();
        let _entered = context.enter().ok();
        let (trainable, _) = crate::planner::trainable(&self.model);
        let (_, layout) = crate::planner::trainable(self.half.as_ref().unwrap_or(&self.model));
        let mut shared = lock(&self.shared);
        let overflow = shared.last.overflow;
        let Some(dynamic) = shared.dynamic.as_mut().filter(|dynamic| dynamic.started) else {
            return;
        };
        let iter = dynamic.steps;
        dynamic.steps += 1;
        let lines = dynamic.engine.end_step(StepEnd {
            iter,
            overflow,
            trainable_elements: trainable / 4,
            layout,
            report: (iter + 1) % 50 == 0,
        });
        match (memsave_common::run::take_failure(), lines) {
            (Some(error), _) | (None, Err(error)) => shared.fail(error),
            (None, Ok(lines)) => {
                for line in lines {
                    tracing::info!(target: "memsave", "{line}");
                }
            }
        }
    }
}
