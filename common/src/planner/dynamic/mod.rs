//! `with_cp = "dynamic"`: a memory budget kept while each step runs, at any input size (the
//! source article's "dynamic memory optimisation", MegEngine's DTR, made exact and per segment).
//!
//! The run's first step is profiled with every segment checkpointed ([`Recording`]), at the
//! input size it has; each segment's first input size is kept with it. From then on each step
//! is decided as it runs, at its first segment's entry ([`crate::checkpoint::dynamic`]):
//! - the step's size is that input's over the nearest profiled one (`ratio`); the profile is
//!   predicted at it (what grows with the input scaled, the weights, state and gradients not).
//!   A step more than [`PROFILE_SPAN`] from every profile is profiled in turn (every segment
//!   checkpointed, the least memory there is), and later steps near its size plan from it
//!   (Mimose's per-size plans, online). Every step is recorded, which gives its measured peak;
//! - the cheapest checkpoint set under the budget is solved for that prediction ([`plan`]),
//!   from what the meter read at the step's start (the batch's own bytes, the optimizer state)
//!   and the error it found in earlier predictions (the margin). Among the segments, those
//!   recomputed are the least valuable by DTR's measure: recomputation seconds per byte freed
//!   over the span the bytes would be held, found exactly rather than greedily;
//! - at each later segment's entry the meter is read again: where more is live than the
//!   prediction said, the segments the plan would keep are recomputed instead, until the
//!   excess is covered.
//!
//! After the step, its measured peak is compared with the budget and its prediction; the
//! prediction's error becomes the margin of the next plans. A step whose least (every segment
//! checkpointed) is over the budget at its size ends with an error naming what holds the memory
//! no segment frees; it is not run over the budget silently.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::checkpoint::dynamic::{set_chooser, SharedChooser};
use crate::checkpoint::SegmentId;
use crate::human_bytes as human;
use crate::memory::Meter;
use crate::planner::recording::{Recording, Staged};
use crate::planner::{Budget, ModelKeys, Profile};
use crate::{Error, Result};

mod chooser;
mod multiscale;
mod predict;

use chooser::*;
pub use multiscale::{compare_multiscale, MultiScaleComparison, OverSizes};
use predict::least;
pub use predict::{
    choose_offloaded, floor_offloaded, holds_most, scaled, IntervalFigures, PROFILE_SPAN,
};

/// How a step ended, as the runtime tells the engine ([`DynamicMemory::end_step`]).
#[derive(Clone, Debug, Default)]
pub struct StepEnd {
    /// The step's number in the run, from 0.
    pub iter: usize,
    /// Whether the optimizer skipped it on a gradient overflow (no step to profile).
    pub overflow: bool,
    /// The trainable parameters' elements (their fp32 bytes are the optimizer's unit).
    pub trainable_elements: u64,
    /// The trainable parameters of the model whose forward ran, in visiting order: module
    /// path and gradient bytes (the gradient estimate of a meter without tags).
    pub layout: Vec<(String, u64)>,
    /// Whether this step ends a logging interval (its figures are said).
    pub report: bool,
}

/// `with_cp = "dynamic"` (see the [module docs](self)), Burn-free: each runtime switches every
/// segment of the model on, calls [`DynamicMemory::start`] before the run, then around each
/// step [`DynamicMemory::begin_step`] (with the paths of the segments of the model that runs the
/// forward), [`DynamicMemory::first_pass_done`] where a step runs its forward twice, and
/// [`DynamicMemory::end_step`], whose lines it logs; [`DynamicMemory::end`] after the run.
/// memsave's `DynamicHook` (Burn 0.21) and `memsave_next::planner::Dynamic` (Burn 0.22) are
/// this.
pub struct DynamicMemory {
    budget: Budget,
    keys: ModelKeys,
    /// Each step is recorded (the recording becomes a profile where its size was far from every
    /// profiled one; elsewhere it gives the step's measured peak).
    recording: Option<Recording>,
    staged: Staged,
    shared: Arc<Mutex<Dynamic>>,
}

impl DynamicMemory {
    /// Keeps `budget` where `meter` reads the memory (the meter the chooser reads at each
    /// segment's entry); `keys` name the model's settings in errors; `staged` reads CPU
    /// staging's counts (bytes copied to the host, the host's optimizer-step seconds).
    pub fn new(budget: Budget, keys: ModelKeys, meter: Box<dyn Meter>, staged: Staged) -> Self {
        DynamicMemory {
            budget,
            keys,
            recording: None,
            staged,
            shared: Arc::new(Mutex::new(Dynamic {
                meter,
                profiling: false,
                ids: HashMap::new(),
                paths: HashMap::new(),
                seen: Vec::new(),
                profiles: Vec::new(),
                budget: 0,
                margin: 0,
                calibrated: false,
                live_at_start: 0,
                step: None,
                below: None,
                staging: None,
                interval: IntervalFigures::default(),
                all: IntervalFigures::default(),
            })),
        }
    }

    /// The budget as configured.
    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// The profiles taken so far (the first, and one per input size far from the others), and
    /// the budget in bytes.
    pub fn profiled(&self) -> (Vec<Profile>, u64) {
        let shared = lock(&self.shared);
        let profiles = shared.profiles.iter().map(|s| s.profile.clone()).collect();
        (profiles, shared.budget)
    }

    /// The figures of the whole run so far.
    pub fn figures(&self) -> IntervalFigures {
        lock(&self.shared).all.clone()
    }

    /// Before the run (every segment of the model switched on by the runtime): the calling
    /// training thread's segments ask this engine at their entries from now on. `staging`: where
    /// CPU staging can save something on the run's device, the link's bytes a second (0: not
    /// measured).
    pub fn start(&mut self, staging: Option<f64>) {
        lock(&self.shared).staging = staging;
        let chooser: SharedChooser = self.shared.clone();
        set_chooser(Some(chooser));
    }

    /// After the run: the chooser removed, a recording left on stopped.
    pub fn end(&mut self) {
        set_chooser(None);
        if self.recording.take().is_some() {
            crate::checkpoint::profile::stop();
        }
    }

    /// Before a step: `meter` reads it (`None`: the step is not recorded), `paths` are the
    /// segments of the model whose forward runs it.
    pub fn begin_step(&mut self, meter: Option<Box<dyn Meter>>, paths: HashMap<SegmentId, String>) {
        let Some(meter) = meter else {
            return;
        };
        let first = lock(&self.shared).profiles.is_empty();
        self.recording = Some(Recording::begin(meter, paths.clone(), self.staged.clone()));
        if first {
            let mut shared = lock(&self.shared);
            shared.paths = paths;
            shared.profiling = true;
            shared.seen.clear();
            shared.live_at_start = shared.meter.live();
            return;
        }
        self.take_ids(paths);
        let mut shared = lock(&self.shared);
        shared.step = None;
        shared.seen.clear();
        shared.live_at_start = shared.meter.live();
    }

    /// A step's first forward and backward (of two) ended: the second runs on the model of
    /// `paths`, with the same choices, by segment.
    pub fn first_pass_done(&mut self, paths: HashMap<SegmentId, String>) {
        if let Some(recording) = self.recording.as_mut() {
            recording.first_pass_done(paths.clone());
        }
        let mut shared = lock(&self.shared);
        shared.seen.clear();
        if shared.profiling {
            shared.paths = paths;
            return;
        }
        drop(shared);
        self.take_ids(paths);
        if let Some(step) = lock(&self.shared).step.as_mut() {
            step.calls = 0;
            step.kept_so_far = 0;
        }
    }

    fn take_ids(&self, paths: HashMap<SegmentId, String>) {
        let mut shared = lock(&self.shared);
        let ids = match shared.profiles.first() {
            Some(sized) => paths
                .iter()
                .filter_map(|(id, path)| {
                    let index = sized
                        .profile
                        .segments
                        .iter()
                        .position(|s| &s.path == path)?;
                    Some((*id, index))
                })
                .collect(),
            None => HashMap::new(),
        };
        shared.ids = ids;
        shared.paths = paths;
    }

    /// The profile of a recording that ended: each segment's first input and each call's entry
    /// from what the chooser saw.
    fn sized(shared: &Dynamic, profile: Profile) -> Sized {
        let index_of = |id: &SegmentId| {
            let path = shared.paths.get(id)?;
            profile.segments.iter().position(|s| &s.path == path)
        };
        let mut elements = vec![0; profile.segments.len()];
        let mut inputs = vec![0; profile.segments.len()];
        let mut entries = Vec::new();
        for (id, count, _, above, bytes) in &shared.seen {
            if let Some(index) = index_of(id) {
                if elements[index] == 0 {
                    elements[index] = *count;
                }
                inputs[index] += *bytes;
                entries.push((index, *above));
            }
        }
        Sized {
            profile,
            elements,
            entries,
            inputs,
        }
    }

    /// After a step: what to log (the profile's line after the first step, a new profile's, a
    /// step over the budget, the interval's figures), or the error that ends the run (the
    /// least a step takes over the budget).
    pub fn end_step(&mut self, end: StepEnd) -> Result<Vec<String>> {
        let Some(recording) = self.recording.take() else {
            return Ok(Vec::new());
        };
        // A step skipped on a gradient overflow is no step to profile.
        if lock(&self.shared).profiling {
            if end.overflow {
                crate::checkpoint::profile::stop();
                return Ok(Vec::new());
            }
            let profile = recording.end(end.trainable_elements * 4, end.layout);
            return self.first_profile(profile);
        }
        let recorded = lock(&self.shared)
            .step
            .as_ref()
            .is_some_and(|s| s.recording);
        let (measured, profile) = if recorded && !end.overflow {
            let profile = recording.end(end.trainable_elements * 4, end.layout);
            let peak = profile.windows.iter().map(|w| w.peak).max().unwrap_or(0);
            (peak, Some(profile))
        } else {
            (events_peak(&crate::checkpoint::profile::stop()), None)
        };
        let mut shared = lock(&self.shared);
        let budget = shared.budget;
        let mut lines = Vec::new();
        if let Some(step) = shared.step.take() {
            let inner = &mut *shared;
            for figures in [&mut inner.interval, &mut inner.all] {
                figures.steps += 1;
                figures.highest_peak = figures.highest_peak.max(measured);
                figures.budget = budget;
                figures.by_size.entry(step.size.clone()).or_default().0 += 1;
            }
            if let Some(profile) = profile {
                let same = profile.segments.len() == inner.profiles[0].profile.segments.len()
                    && profile
                        .segments
                        .iter()
                        .zip(&inner.profiles[0].profile.segments)
                        .all(|(a, b)| a.path == b.path);
                if measured > budget {
                    let message = format!(
                        "at this input size (a first segment input of shape {}) one step with \
                         every segment checkpointed peaked at {}, above the memory budget of {}. \
                         What holds the most is {}; no choice of segments frees it. Lower the \
                         largest input (the pipeline's `img_scale`) or the batch (`{}`), put \
                         more of the model in segments, or switch on mixed precision or 8-bit \
                         optimizer state",
                        step.size,
                        human(measured),
                        human(budget),
                        holds_most(&profile),
                        self.keys.batch
                    );
                    return Err(Error::OutOfMemory {
                        what: "one step at this input size".into(),
                        needed: measured,
                        place: format!("the memory budget `{}`", self.budget),
                        available: Some(budget),
                        advice: message,
                    });
                }
                if same {
                    lines.push(format!(
                        "dynamic: step {} profiled at a first input of {} ({:.2}x the nearest \
                         profiled one): peak {} with every segment checkpointed; {} profiles",
                        end.iter + 1,
                        step.size,
                        step.ratio,
                        human(measured),
                        inner.profiles.len() + 1
                    ));
                    let sized = Self::sized(inner, profile);
                    inner.profiles.push(sized);
                }
            } else if !step.recording {
                let error = measured.saturating_sub(step.predicted_peak);
                if !inner.calibrated {
                    inner.margin = error;
                    inner.calibrated = true;
                } else if error > inner.margin {
                    inner.margin = error;
                }
            }
            if measured > budget {
                lines.push(format!(
                    "dynamic: step {} at {} peaked at {}, over the budget {} (predicted {}); \
                     the next steps plan {} lower",
                    end.iter + 1,
                    step.size,
                    human(measured),
                    human(budget),
                    human(step.predicted_peak),
                    human(inner.margin)
                ));
            }
        }
        let figures = if end.report {
            std::mem::take(&mut shared.interval)
        } else {
            IntervalFigures::default()
        };
        drop(shared);
        if end.report && figures.steps > 0 {
            let sizes: Vec<String> = figures
                .by_size
                .iter()
                .map(|(size, (steps, kept, recomputed))| {
                    format!("{size}: {steps} steps, kept {kept}, recomputed {recomputed}")
                })
                .collect();
            lines.push(format!(
                "dynamic: iters up to {}: segments kept {}, recomputed {} ({} of them turned by \
                 the meter, {} with their inputs in host memory); highest step peak {} of the \
                 budget {}; by input: {}",
                end.iter + 1,
                figures.kept,
                figures.recomputed,
                figures.turned,
                figures.offloaded,
                human(figures.highest_peak),
                human(budget),
                sizes.join("; ")
            ));
        }
        Ok(lines)
    }

    /// The first step's profile: the budget in bytes, checked against what the least
    /// checkpointing gives; the line that says so.
    fn first_profile(&mut self, profile: Profile) -> Result<Vec<String>> {
        let unplanned = profile.unplanned_peak();
        let budget = self.budget.bytes(unplanned);
        let mut shared = lock(&self.shared);
        shared.profiling = false;
        // With CPU staging, the least is every segment recomputed and its inputs in host memory.
        let sized = Self::sized(&shared, profile);
        let profile = &sized.profile;
        let recomputed_floor = profile.floor();
        let floor = least(profile, &sized.inputs, shared.staging.is_some());
        let weights = profile.resident + profile.growth;
        if weights >= budget || floor > budget {
            let advice = if weights >= budget {
                format!(
                    "the weights, optimizer state and data alone take {}: lower them (mixed \
                     precision, 8-bit optimizer state, optimizer offload, ZeRO) or raise the \
                     budget",
                    human(weights)
                )
            } else {
                format!(
                    "the least a step takes at the profiled input, every segment checkpointed \
                     (`{}`), is {} (weights, state and data {}); {}; a larger input takes more. \
                     Lower the input's size or the batch (`{}`), put more of the model in \
                     segments, or switch on mixed precision or 8-bit optimizer state",
                    self.keys.with_cp,
                    human(floor),
                    human(weights),
                    holds_most(profile),
                    self.keys.batch
                )
            };
            return Err(Error::OutOfMemory {
                what: format!(
                    "one step with every one of the {} segments checkpointed, the least \
                     \"dynamic\" can give,",
                    profile.segments.len()
                ),
                needed: floor.max(weights),
                place: format!("the memory budget `{}`", self.budget),
                available: Some(budget),
                advice,
            });
        }
        let staged = match shared.staging {
            Some(link) if link > 0.0 => format!(
                "; {} with their inputs in host memory too (the link {:.2} GB/s)",
                human(floor),
                link / 1e9
            ),
            Some(_) => format!("; {} with their inputs in host memory too", human(floor)),
            None => String::new(),
        };
        let line = format!(
            "dynamic: budget {} ({}); profiled at a first input of {:?}: peak {} without \
             checkpointing, {} with every one of {} segments checkpointed{staged}",
            human(budget),
            self.budget,
            shared.seen.first().map(|s| s.2.clone()).unwrap_or_default(),
            human(unplanned),
            human(recomputed_floor),
            profile.segments.len(),
        );
        shared.budget = budget;
        // The first step that keeps segments is the first whose backward runs them on the
        // training thread, and what that leaves live until the next backward (Burn's graph,
        // per-thread buffers) no profile with every segment checkpointed saw (measured on a
        // 16-channel convolutional net: 2.1 MB, 8% of its budget, from then on in every step's
        // start). It plans below the budget by one segment call's activations; its measured
        // error is the margin after it.
        shared.margin = profile
            .segments
            .iter()
            .map(|s| s.kept_bytes / s.calls.max(1) as u64)
            .max()
            .unwrap_or(0);
        shared.calibrated = false;
        let staged_floor = shared.staging.map(|_| floor);
        let inner = &mut *shared;
        for figures in [&mut inner.interval, &mut inner.all] {
            figures.floor = recomputed_floor;
            figures.floor_offloaded = staged_floor;
        }
        shared.profiles.push(sized);
        Ok(vec![line])
    }
}

#[cfg(test)]
mod tests;
