//! The hook that measures each configuration's optimizer steps in its worker process: time,
//! peak above the step's start, the bytes each tag added, the timeline of the last step.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use memsave::memory::{self, TagBytes, Timeline};
use memsave::train::{Hook, TrainModel, TrainState};
use memsave::{Error, Result};

use super::super::worker::Report;

/// What the measuring hook records.
#[derive(Default)]
pub(super) struct Record {
    /// Live bytes at the start of the first measured step.
    pub(super) resident: Option<u64>,
    /// Per measured step: seconds, peak above its start, the bytes each tag added from the
    /// step's start to its peak, and the live bytes at its start.
    pub(super) steps: Vec<(f64, u64, Vec<TagBytes>, u64)>,
    /// Per step: the mean loss of its micro-batches.
    pub(super) losses: Vec<f64>,
    pub(super) timeline: Vec<memory::Sample>,
    /// Segments recomputed in the measured steps' backward passes (a count, not a sample).
    pub(super) recomputations: u64,
    /// On a device: the host's highest live bytes over the measured steps (the counting
    /// allocator's).
    pub(super) host_peak: Option<usize>,
}

/// Times each optimizer step (a group of `micro` iterations), and takes its peak.
pub(super) struct Measure {
    pub(super) micro: usize,
    pub(super) paced: bool,
    pub(super) warmup: usize,
    pub(super) last: usize,
    pub(super) meter: Rc<dyn memory::Meter>,
    pub(super) record: Rc<RefCell<Record>>,
    /// The measured step's start: when, the live bytes, the bytes per tag, the recomputations
    /// counted so far.
    pub(super) started: Option<(Instant, u64, Vec<TagBytes>, u64)>,
    pub(super) timeline: Option<Timeline>,
    pub(super) losses: Vec<f64>,
    /// Whether the host's bytes are measured beside the device's (a device run).
    pub(super) host: bool,
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for Measure {
    fn name(&self) -> &'static str {
        "bench"
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if !state.iter.is_multiple_of(self.micro) {
            return Ok(());
        }
        if self.paced {
            super::super::worker::wait_for_turn()?;
        }
        let group = state.iter / self.micro;
        if group < self.warmup {
            self.started = None;
            return Ok(());
        }
        let live = self.meter.live();
        let mut record = self.record.borrow_mut();
        record.resident.get_or_insert(live);
        drop(record);
        if group == self.last && self.meter.tags() {
            // Room for a sample every millisecond of a long step.
            self.timeline = Some(
                Timeline::start(std::time::Duration::from_millis(1), 1 << 17).map_err(|e| {
                    Error::Data(format!("could not start the timeline's thread: {e}"))
                })?,
            );
        }
        let at_start = if self.meter.tags() {
            memory::live_by_tag()
        } else {
            Vec::new()
        };
        let baseline = self.meter.reset_peak();
        if self.host {
            memory::reset_peak();
        }
        let recomputed = memsave::checkpoint::recomputations();
        self.started = Some((Instant::now(), baseline, at_start, recomputed));
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if let Some(loss) = state.log.loss {
            self.losses.push(loss);
        }
        if !(state.iter + 1).is_multiple_of(self.micro) {
            return Ok(());
        }
        let mean = self.losses.iter().sum::<f64>() / self.losses.len().max(1) as f64;
        self.losses.clear();
        let mut record = self.record.borrow_mut();
        record.losses.push(mean);
        if let Some((started, baseline, at_start, recomputed)) = self.started.take() {
            let seconds = started.elapsed().as_secs_f64();
            record.recomputations +=
                memsave::checkpoint::recomputations().saturating_sub(recomputed);
            let peak = self.meter.peak().saturating_sub(baseline);
            // What each tag added between the step's start and its peak.
            let mut at_peak = if self.meter.tags() {
                memory::peak_by_tag()
            } else {
                Vec::new()
            };
            for tag in &mut at_peak {
                if let Some(start) = at_start.iter().find(|s| s.tag == tag.tag) {
                    tag.live -= start.live;
                }
            }
            record.steps.push((seconds, peak, at_peak, baseline));
            if self.host {
                let host = memory::peak_bytes();
                record.host_peak = Some(record.host_peak.map_or(host, |h| h.max(host)));
            }
            if let Some(timeline) = self.timeline.take() {
                record.timeline = timeline.stop();
            }
        }
        let group = state.iter / self.micro + 1;
        // The parent's progress bar reads these reports.
        super::super::worker::send(&Report::<()>::Step { done: group as u64 })?;
        Ok(())
    }
}
