//! The chooser `"dynamic"` installs for a run: each step planned at its first segment's entry,
//! each later entry kept or recomputed against the meter's reading.

use std::collections::HashMap;
use std::sync::Mutex;

use super::predict::*;
use crate::checkpoint::dynamic::{Choice, Chooser};
use crate::checkpoint::SegmentId;
use crate::human_bytes as human;
use crate::memory::Meter;
use crate::planner::{plan, Profile};
use crate::Error;

/// One step's choice.
#[derive(Clone, Debug)]
pub(super) struct StepChoice {
    pub(super) size: String,
    pub(super) ratio: f64,
    /// The profile it was planned from (an index in `Dynamic::profiles`).
    pub(super) profile: usize,
    /// Whether the step is profiled instead (every segment checkpointed): its size is far from
    /// every profiled one.
    pub(super) recording: bool,
    pub(super) checkpointed: Vec<bool>,
    /// Per segment: whether its inputs wait in host memory (it is recomputed too).
    pub(super) offloaded: Vec<bool>,
    pub(super) predicted_peak: u64,
    /// Bytes the meter found live beyond the prediction, the most at any entry.
    pub(super) short: u64,
    /// Bytes the turned segments keep no more.
    pub(super) covered: u64,
    /// Bytes kept by the segments entered so far.
    pub(super) kept_so_far: u64,
    /// The segment entries so far.
    pub(super) calls: usize,
}

/// A profile, at the input size it was taken at.
pub(super) struct Sized {
    pub(super) profile: Profile,
    /// Per segment: its first call's input elements.
    pub(super) elements: Vec<u64>,
    /// Per call: its segment and the live bytes above the step's start at its entry.
    pub(super) entries: Vec<(usize, u64)>,
    /// Per segment: the float input bytes of its calls (what offloading it takes off the
    /// device).
    pub(super) inputs: Vec<u64>,
}

/// The state the hook and the run's chooser share.
pub(super) struct Dynamic {
    pub(super) meter: Box<dyn Meter>,
    pub(super) profiling: bool,
    /// Segment identities of the model that runs the step, to their index in the profile (or,
    /// while profiling, to their path).
    pub(super) ids: HashMap<SegmentId, usize>,
    pub(super) paths: HashMap<SegmentId, String>,
    /// While profiling: per call in order, the segment, its first input's elements and shape,
    /// and the live bytes above the step's start at its entry.
    /// ... and its float input bytes.
    pub(super) seen: Vec<(SegmentId, u64, Vec<usize>, u64, u64)>,
    /// The profiles taken, one per input size far enough from the others.
    pub(super) profiles: Vec<Sized>,
    pub(super) budget: u64,
    /// What later plans keep below the budget: the most a step's measured peak has exceeded
    /// its prediction; before the first planned step, one segment call's activations.
    pub(super) margin: u64,
    /// Whether a planned step has measured the margin.
    pub(super) calibrated: bool,
    pub(super) live_at_start: u64,
    pub(super) step: Option<StepChoice>,
    /// A step whose least is over the budget: the error, recorded once.
    pub(super) below: Option<String>,
    /// Where CPU staging can save something on the run's device: the link's bytes a second
    /// (0: not measured), which prices an offloaded segment's copies.
    pub(super) staging: Option<f64>,
    pub(super) interval: IntervalFigures,
    pub(super) all: IntervalFigures,
}

impl Dynamic {
    pub(super) fn plan_step(&mut self, index: usize, shape: &[usize], elements: u64) -> StepChoice {
        let size = format!("{shape:?}");
        // The profile nearest in size.
        let (k, ratio) = self
            .profiles
            .iter()
            .enumerate()
            .map(|(k, sized)| (k, elements as f64 / sized.elements[index].max(1) as f64))
            .min_by(|a, b| a.1.ln().abs().total_cmp(&b.1.ln().abs()))
            .expect("planned after the first profile");
        let mut choice = StepChoice {
            size,
            ratio,
            profile: k,
            recording: false,
            checkpointed: Vec::new(),
            offloaded: Vec::new(),
            predicted_peak: 0,
            short: 0,
            covered: 0,
            kept_so_far: 0,
            calls: 0,
        };
        let sized = &self.profiles[k];
        let profile = &sized.profile;
        if ratio.ln().abs() > PROFILE_SPAN.ln() {
            // Far from every profile: this step is profiled, every segment checkpointed (the
            // least memory there is), and later steps of its size plan from it.
            choice.recording = true;
            choice.checkpointed = vec![true; profile.segments.len()];
            choice.predicted_peak = scaled(profile, ratio).floor();
            return choice;
        }
        let at = scaled(profile, ratio);
        // What the meter read at the step's start beyond the profiled start and the state the
        // first step made (a larger batch's own bytes): in every window.
        let shift = self
            .live_at_start
            .saturating_sub(profile.resident + profile.growth);
        let budget = self.budget.saturating_sub(self.margin + shift);
        let all = vec![true; at.segments.len()];
        // Where recomputing alone cannot keep the budget and CPU staging can save something,
        // the largest inputs wait in host memory too.
        let inputs: Vec<u64> = sized
            .inputs
            .iter()
            .map(|&bytes| (bytes as f64 * ratio) as u64)
            .collect();
        let planned = plan(&at, budget);
        let offloaded = match (&planned, self.staging) {
            (Err(_), Some(_)) => choose_offloaded(&at, &inputs, budget),
            _ => None,
        };
        if let Some((offloaded, peak)) = offloaded {
            choice.predicted_peak = peak + shift;
            choice.checkpointed = all;
            choice.offloaded = offloaded;
            return choice;
        }
        let floor = least(&at, &inputs, self.staging.is_some()) + shift;
        match planned {
            Ok(plan) => {
                choice.predicted_peak = plan.peak + shift;
                choice.checkpointed = plan.checkpointed;
                return choice;
            }
            Err(_) if floor > self.budget => {
                self.below = Some(format!(
                    "at this input size (a first segment input of shape {}, {ratio:.2}x the \
                     nearest profiled one), one step with every segment checkpointed is \
                     predicted to peak at {} (the weights, optimizer state and gradients {} of \
                     it), above the memory budget of {}. What holds the most is {}; no choice \
                     of segments frees it. Lower the largest input (the pipeline's \
                     `img_scale`) or the batch, put more of the model in segments, or switch on \
                     mixed precision or 8-bit optimizer state",
                    choice.size,
                    human(floor),
                    human(at.resident + at.growth + at.trainable),
                    human(self.budget),
                    holds_most(&at),
                ));
            }
            // Under the margin nothing fits, and without it the least does: the least, then.
            Err(_) => {}
        }
        choice.predicted_peak = floor;
        if self.staging.is_some() {
            choice.offloaded = vec![true; all.len()];
        }
        choice.checkpointed = all;
        choice
    }
}

impl Chooser for Dynamic {
    fn choose(&mut self, id: SegmentId, shape: &[usize], bytes: u64) -> Option<Choice> {
        let elements: u64 = shape.iter().map(|&d| d as u64).product();
        if self.profiling {
            let above = self.meter.live().saturating_sub(self.live_at_start);
            self.seen.push((id, elements, shape.to_vec(), above, bytes));
            return None;
        }
        let index = *self.ids.get(&id)?;
        if self.profiles.is_empty() {
            return None;
        }
        if self.step.is_none() {
            let choice = self.plan_step(index, shape, elements);
            if let Some(message) = self.below.take() {
                crate::run::fail(Error::OutOfMemory {
                    what: "one step at this input size".into(),
                    needed: choice.predicted_peak,
                    place: "the memory budget (`memory.memory_budget`)".into(),
                    available: Some(self.budget),
                    advice: message,
                });
            }
            self.step = Some(choice);
        }
        let live = self.meter.live();
        let step = self.step.as_mut()?;
        if step.recording {
            // A profiled step: every segment checkpointed, each entry kept for the profile.
            let above = live.saturating_sub(self.live_at_start);
            self.seen.push((id, elements, shape.to_vec(), above, bytes));
            for figures in [&mut self.interval, &mut self.all] {
                figures.recomputed += 1;
                figures.by_size.entry(step.size.clone()).or_default().2 += 1;
            }
            return Some(Choice::Recompute);
        }
        let sized = &self.profiles[step.profile];
        let profile = &sized.profile;
        let call = step.calls;
        step.calls += 1;
        let per_call = |i: usize| {
            let segment = &profile.segments[i];
            (segment.kept_bytes as f64 * step.ratio / segment.calls.max(1) as f64) as u64
        };
        // The meter against the prediction at this entry.
        if let Some(&(profiled, above)) = sized.entries.get(call) {
            if profiled == index {
                let predicted =
                    self.live_at_start + (above as f64 * step.ratio) as u64 + step.kept_so_far;
                step.short = step.short.max(live.saturating_sub(predicted));
            }
        }
        let mut checkpointed = step.checkpointed.get(index).copied().unwrap_or(true);
        // Turned only where the excess would carry the step's predicted peak over the budget.
        let room = self
            .budget
            .saturating_sub(self.margin)
            .saturating_sub(step.predicted_peak);
        let turned = !checkpointed && step.short.saturating_sub(room) > step.covered;
        if turned {
            checkpointed = true;
            step.covered += per_call(index);
        }
        if !checkpointed {
            step.kept_so_far += per_call(index);
        }
        let offloaded = checkpointed && step.offloaded.get(index).copied().unwrap_or(false);
        for figures in [&mut self.interval, &mut self.all] {
            let by_size = figures.by_size.entry(step.size.clone()).or_default();
            if checkpointed {
                figures.recomputed += 1;
                by_size.2 += 1;
            } else {
                figures.kept += 1;
                by_size.1 += 1;
            }
            figures.turned += turned as usize;
            figures.offloaded += offloaded as usize;
        }
        Some(if offloaded {
            Choice::Offload
        } else if checkpointed {
            Choice::Recompute
        } else {
            Choice::Keep
        })
    }
}

/// The shared state, as the engine reads it.
pub(super) fn lock(shared: &Mutex<Dynamic>) -> std::sync::MutexGuard<'_, Dynamic> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// The highest live bytes a recording's events saw.
pub(super) fn events_peak(events: &[crate::checkpoint::profile::Event]) -> u64 {
    use crate::checkpoint::profile::Event;
    events
        .iter()
        .filter_map(|event| match event {
            Event::Boundary { window_peak, .. } | Event::Recompute { window_peak, .. } => {
                Some(*window_peak)
            }
            _ => None,
        })
        .max()
        .unwrap_or(0)
}
