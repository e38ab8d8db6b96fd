//! What memsave does, as burn-train metrics: the loss, the loss scale, the steps skipped on
//! overflow, the micro-batch's place in its group and the gradients' norm, shown by burn-train's
//! own renderers and loggers (`training.metrics(memsave.metrics())`).
//!
//! burn-train updates its metrics on a thread of its own, after the step. Each metric reads the
//! record memsave kept of *its* micro-batch (the micro-batches are recorded in order, and a
//! training metric sees each once, in order), not the state at the time it runs, so the values
//! belong to the micro-batch they are shown with.
//!
//! The metrics also tell memsave the run's length where burn-train knows it
//! ([`Memsave::accumulate_auto`](super::Memsave::accumulate_auto)): the number of epochs from
//! burn-train's progress, the micro-batches per epoch when the first epoch ends.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};
use burn::train::{LearningComponentsTypes, MetricRegistration, SupervisedTraining};

use super::{lock, Shared, StepReport};

/// Micro-batches kept for metrics that lag behind the training (their thread runs behind it).
const KEPT: usize = 4096;

/// A micro-batch's loss, read when a metric asks for it (reading waits for the device).
#[derive(Clone)]
pub(crate) struct LazyLoss(pub(crate) Arc<dyn Fn() -> f64 + Send + Sync>);

impl std::fmt::Debug for LazyLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LazyLoss")
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

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "History({}..{})", self.start, self.end())
    }
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

    /// Micro-batch `number`, or the oldest kept if it is gone.
    fn get(&self, number: u64) -> Option<&Seen> {
        let index = number.saturating_sub(self.start) as usize;
        self.seen.get(index)
    }
}

/// Learns the run's length from burn-train's progress.
#[derive(Clone, Debug, Default)]
pub(crate) struct RunLength {
    /// Asked for by `accumulate_auto`.
    pub(crate) wanted: bool,
    epochs: Option<usize>,
    /// The epoch being seen, and its last iteration.
    epoch: Option<(usize, usize)>,
    per_epoch: Option<usize>,
}

impl RunLength {
    /// Reads one item's progress; returns the run's micro-batches once known.
    fn observe(&mut self, metadata: &MetricMetadata) -> Option<usize> {
        let epoch = metadata.global_progress.items_processed;
        self.epochs = Some(metadata.global_progress.items_total);
        let iteration = metadata.iteration?;
        match self.epoch {
            Some((seen, last)) if seen != epoch => {
                // A new epoch: the one before held `last` micro-batches (burn-train resumes at
                // an epoch's start, so a finished epoch was seen whole).
                self.per_epoch.get_or_insert(last);
                self.epoch = Some((epoch, iteration));
            }
            _ => self.epoch = Some((epoch, iteration)),
        }
        self.total()
    }

    /// The epoch ended (burn-train clears its metrics then).
    fn end_epoch(&mut self) -> Option<usize> {
        if let Some((_, last)) = self.epoch {
            self.per_epoch.get_or_insert(last);
        }
        self.total()
    }

    fn total(&self) -> Option<usize> {
        Some(self.per_epoch? * self.epochs?)
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

    /// The value for one micro-batch; `None` where it has none (no step, no scale).
    fn value(self, seen: &Seen) -> Option<f64> {
        let report = &seen.report;
        match self {
            Quantity::Loss => seen.loss.as_ref().map(|loss| (loss.0)()),
            Quantity::LossScale => report.loss_scale,
            Quantity::SkippedSteps => Some(report.skipped_steps as f64),
            Quantity::MicroBatch => Some(report.micro_batch as f64),
            Quantity::GradNorm => report.grad_norm,
        }
    }
}

/// One of memsave's quantities as a burn-train numeric metric (see the module docs).
/// Make them with [`Memsave::metrics`](super::Memsave::metrics).
#[derive(Clone)]
pub struct MemsaveMetric {
    quantity: Quantity,
    name: MetricName,
    shared: Arc<Mutex<Shared>>,
    /// The number of the next micro-batch this metric shows.
    next: u64,
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
            state: NumericMetricState::new(),
        }
    }

    /// What this metric shows.
    pub fn quantity(&self) -> Quantity {
        self.quantity
    }
}

impl Metric for MemsaveMetric {
    type Input = ();

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn description(&self) -> Option<String> {
        Some(
            match self.quantity {
                Quantity::Loss => "the micro-batch's loss, before memsave's factor and scale",
                Quantity::LossScale => "the dynamic loss scale after the micro-batch",
                Quantity::SkippedSteps => "optimizer steps skipped on gradient overflow so far",
                Quantity::MicroBatch => "the micro-batch's place in its accumulation group",
                Quantity::GradNorm => "the global gradient norm at each optimizer step",
            }
            .to_string(),
        )
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }

    fn update(&mut self, _: &(), metadata: &MetricMetadata) -> SerializedEntry {
        let seen = {
            let mut shared = lock(&self.shared);
            let seen = shared.history.get(self.next).cloned();
            if shared.run_length.wanted {
                if let Some(total) = shared.run_length.observe(metadata) {
                    shared.set_derived_length(total);
                }
            }
            seen
        };
        self.next += 1;
        let value = seen
            .as_ref()
            .and_then(|seen| self.quantity.value(seen))
            // A micro-batch without a value (no step yet, fp32's scale) repeats the last one.
            .or_else(|| match self.state.current_value() {
                NumericEntry::Aggregated {
                    aggregated_value, ..
                } if aggregated_value.is_finite() => Some(aggregated_value),
                _ => None,
            })
            .unwrap_or(0.0);
        let precision = match self.quantity {
            Quantity::SkippedSteps | Quantity::MicroBatch => 0,
            Quantity::LossScale => 1,
            Quantity::Loss | Quantity::GradNorm => 4,
        };
        self.state.update(
            value,
            1,
            FormatOptions::new(self.name.clone()).precision(precision),
        )
    }

    fn clear(&mut self) {
        self.state.reset();
        let mut shared = lock(&self.shared);
        if shared.run_length.wanted {
            if let Some(total) = shared.run_length.end_epoch() {
                shared.set_derived_length(total);
            }
        }
    }
}

impl Numeric for MemsaveMetric {
    fn value(&self) -> NumericEntry {
        self.state.current_value()
    }

    fn running_value(&self) -> NumericEntry {
        self.state.running_value()
    }
}

/// memsave's metrics for a burn-train run, registered on the training split only (they describe
/// the optimizer, not the model): `training.metrics(memsave.metrics())`. The loss scale is
/// among them under mixed precision, the micro-batch's place under accumulation.
#[derive(Clone)]
pub struct MemsaveMetrics {
    metrics: Vec<MemsaveMetric>,
}

impl MemsaveMetrics {
    pub(crate) fn new(shared: &Arc<Mutex<Shared>>) -> Self {
        let (mixed, grouped) = {
            let mut shared = lock(shared);
            shared.metrics_registered = true;
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
        }
    }

    /// The metrics, one per quantity.
    pub fn metrics(&self) -> &[MemsaveMetric] {
        &self.metrics
    }
}

impl<LC: LearningComponentsTypes> MetricRegistration<LC> for MemsaveMetrics {
    fn register(self, mut training: SupervisedTraining<LC>) -> SupervisedTraining<LC> {
        // The handle that stops the training where a step fails (`Shared::fail`).
        if let Some(metric) = self.metrics.first() {
            lock(&metric.shared).interrupter = Some(super::Interrupter(training.interrupter()));
        }
        for metric in self.metrics {
            training = training.metric_train_numeric(metric);
        }
        training
    }
}
