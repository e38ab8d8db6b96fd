//! What memsave does, as burn-train metrics: the loss, the loss scale, the steps skipped on
//! overflow, the micro-batch's place in its group and the gradients' norm, shown by burn-train's
//! own renderers and loggers (`training.metrics(memsave.metrics())`).
//!
//! burn-train 0.22 updates its metrics on a thread of its own, after the step (the item is sent
//! after `optimize`). Each metric reads the record memsave kept of *its* micro-batch (recorded in
//! order; a training metric sees each once, in order), not the state at the time it runs, so the
//! values belong to the micro-batch they are shown with.
//!
//! Registering them also hands burn-train's interrupter to memsave where
//! [`Memsave::interrupter`](super::Memsave::interrupter) was not called: an error of memsave's
//! then stops the training cleanly.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use burn::tensor::TensorReadError;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};
use burn::train::{LearnerModel, MetricRegistration, SupervisedTraining};

use super::{lock, Shared, StepReport};

/// Micro-batches kept for metrics that lag behind the training (their thread runs behind it).
const KEPT: usize = 4096;

/// A micro-batch's loss (without its graph), read when a metric asks for it (reading waits for
/// the device).
#[derive(Clone)]
pub(crate) struct LazyLoss(pub(crate) Arc<Mutex<burn::tensor::Tensor<1>>>);

impl LazyLoss {
    pub(crate) fn new(loss: burn::tensor::Tensor<1>) -> Self {
        LazyLoss(Arc::new(Mutex::new(loss.inner())))
    }

    fn read(&self) -> f64 {
        let loss = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        loss.cast(burn::tensor::DType::F32).into_scalar::<f64>()
    }
}

/// What the metrics read of one micro-batch.
#[derive(Clone)]
pub(crate) struct Seen {
    pub(crate) report: StepReport,
    pub(crate) loss: Option<LazyLoss>,
}

/// The micro-batches recorded for the metrics, numbered from the run's first.
#[derive(Clone, Default)]
pub(crate) struct History {
    seen: VecDeque<Seen>,
    /// The number of the first one kept.
    start: u64,
}

impl History {
    pub(crate) fn push(&mut self, seen: Seen) {
        if self.seen.len() == KEPT {
            self.seen.pop_front();
            self.start += 1;
        }
        self.seen.push_back(seen);
    }

    /// The number the next micro-batch will have.
    pub(crate) fn end(&self) -> u64 {
        self.start + self.seen.len() as u64
    }

    /// Micro-batch `number`, where it is still kept.
    fn get(&self, number: u64) -> Option<&Seen> {
        let index = number.checked_sub(self.start)? as usize;
        self.seen.get(index)
    }
}

/// Which quantity a [`MemsaveMetric`] shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantity {
    /// The micro-batch's loss, as the model returned it (before the accumulation factor and the
    /// loss scale).
    Loss,
    /// The loss scale after the micro-batch (mixed precision).
    LossScale,
    /// Optimizer steps skipped so far because the gradients overflowed (inf or NaN).
    SkippedSteps,
    /// The micro-batch's place in its group of `cumulative_iters`, from 1.
    MicroBatch,
    /// The global norm of the group's gradients (unscaled, before clipping), at each step.
    GradNorm,
}

impl Quantity {
    fn name(self) -> &'static str {
        match self {
            Quantity::Loss => "memsave Loss",
            Quantity::LossScale => "memsave Loss Scale",
            Quantity::SkippedSteps => "memsave Skipped Steps",
            Quantity::MicroBatch => "memsave Micro-batch In Group",
            Quantity::GradNorm => "memsave Grad Norm",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Quantity::Loss => "the micro-batch's loss, before memsave's factor and scale",
            Quantity::LossScale => "the dynamic loss scale after the micro-batch",
            Quantity::SkippedSteps => "optimizer steps skipped on gradient overflow so far",
            Quantity::MicroBatch => "the micro-batch's place in its accumulation group",
            Quantity::GradNorm => "the global gradient norm at each optimizer step",
        }
    }

    fn precision(self) -> usize {
        match self {
            Quantity::SkippedSteps | Quantity::MicroBatch => 0,
            Quantity::LossScale => 1,
            Quantity::Loss | Quantity::GradNorm => 4,
        }
    }

    /// The value for one micro-batch; `None` where it has none (no step, no scale).
    fn value(self, seen: &Seen) -> Option<f64> {
        let report = &seen.report;
        match self {
            Quantity::Loss => seen.loss.as_ref().map(LazyLoss::read),
            Quantity::LossScale => report.loss_scale,
            Quantity::SkippedSteps => Some(report.skipped_steps as f64),
            Quantity::MicroBatch => Some(report.micro_batch as f64),
            Quantity::GradNorm => report.grad_norm,
        }
    }
}

/// One of memsave's quantities as a burn-train numeric metric (see the module docs). Make them
/// with [`Memsave::metrics`](super::Memsave::metrics).
#[derive(Clone)]
pub struct MemsaveMetric {
    quantity: Quantity,
    name: MetricName,
    shared: Arc<Mutex<Shared>>,
    /// The number of the next micro-batch this metric shows.
    next: u64,
    /// The last value shown (a micro-batch without one repeats it).
    last: Option<f64>,
    state: NumericMetricState,
}

impl MemsaveMetric {
    pub(crate) fn new(quantity: Quantity, shared: Arc<Mutex<Shared>>) -> Self {
        let next = lock(&shared).history.end();
        MemsaveMetric {
            quantity,
            name: Arc::new(quantity.name().to_string()),
            shared,
            next,
            last: None,
            state: NumericMetricState::new(),
        }
    }

    /// What this metric shows.
    pub fn quantity(&self) -> Quantity {
        self.quantity
    }

    fn format(&self) -> FormatOptions {
        FormatOptions::new(self.name.clone()).precision(self.quantity.precision())
    }
}

impl Metric for MemsaveMetric {
    type Input = ();

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn description(&self) -> Option<String> {
        Some(self.quantity.description().to_string())
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }

    fn update(
        &mut self,
        _: &(),
        _metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let seen = lock(&self.shared).history.get(self.next).cloned();
        self.next += 1;
        // A micro-batch without a value (no step yet, fp32's scale) repeats the last one.
        let value = seen
            .as_ref()
            .and_then(|seen| self.quantity.value(seen))
            .or(self.last)
            .unwrap_or(0.0);
        self.last = Some(value);
        self.state.update(value, 1);
        Ok(self.state.compute_update(self.format()))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.state.compute_final(self.format()))
    }

    fn clear(&mut self) {
        self.state.reset();
    }
}

impl Numeric for MemsaveMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }

    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }

    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}

/// memsave's metrics for a burn-train run, registered on the training split only (they describe
/// the optimizer, not the model): `training.metrics(memsave.metrics())`. The loss scale and the
/// skipped steps are among them under mixed precision, the micro-batch's place under
/// accumulation.
#[derive(Clone)]
pub struct MemsaveMetrics {
    metrics: Vec<MemsaveMetric>,
    shared: Arc<Mutex<Shared>>,
}

impl MemsaveMetrics {
    pub(crate) fn new(shared: &Arc<Mutex<Shared>>) -> Self {
        let (mixed, grouped) = {
            let shared = lock(shared);
            (
                shared.mixed.is_some(),
                shared.groups().cumulative_iters() > 1,
            )
        };
        let mut quantities = vec![Quantity::Loss];
        if mixed {
            quantities.extend([Quantity::LossScale, Quantity::SkippedSteps]);
        }
        if grouped {
            quantities.push(Quantity::MicroBatch);
        }
        quantities.push(Quantity::GradNorm);
        MemsaveMetrics {
            metrics: quantities
                .into_iter()
                .map(|quantity| MemsaveMetric::new(quantity, shared.clone()))
                .collect(),
            shared: shared.clone(),
        }
    }

    /// The metrics, one per quantity.
    pub fn metrics(&self) -> &[MemsaveMetric] {
        &self.metrics
    }
}

impl<M: LearnerModel> MetricRegistration<M> for MemsaveMetrics {
    fn register(self, mut training: SupervisedTraining<M>) -> SupervisedTraining<M> {
        // The handle that stops the training where a step fails (`Shared::fail`): the
        // training's own, unless memsave's was asked for (and is given with
        // `with_interrupter`).
        lock(&self.shared)
            .interrupter
            .get_or_insert_with(|| training.interrupter());
        for metric in self.metrics {
            training = training.metric_train_numeric(metric);
        }
        training
    }
}
