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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::recording::{Recording, Staged};
use super::{plan, Budget, ModelKeys, Profile};
use crate::checkpoint::dynamic::{set_chooser, Choice, Chooser, SharedChooser};
use crate::checkpoint::SegmentId;
use crate::human_bytes as human;
use crate::memory::Meter;
use crate::{Error, Result};

/// The profile predicted at `ratio` times the profiled input: the bytes above the weights,
/// state and gradients in each window that grows with the input, the segments' kept bytes and
/// times, scaled; the rest as measured.
pub fn scaled(profile: &Profile, ratio: f64) -> Profile {
    let scale = |bytes: u64| (bytes as f64 * ratio).round() as u64;
    let mut out = profile.clone();
    for window in &mut out.windows {
        if window.batch_scaled {
            let base = profile.resident + window.gradients;
            let above = window.peak.saturating_sub(base);
            window.peak = base + scale(above);
            for (_, bytes) in &mut window.alive {
                *bytes = scale(*bytes);
            }
            for (_, held) in &mut window.recomputed {
                *held = scale(*held);
            }
        }
    }
    for segment in &mut out.segments {
        segment.kept_bytes = scale(segment.kept_bytes);
        segment.output_bytes = scale(segment.output_bytes);
        segment.recompute_seconds *= ratio;
        segment.forward_seconds *= ratio;
    }
    let passes = profile.forward_seconds + profile.backward_seconds;
    out.step_seconds = (profile.step_seconds - passes).max(0.0) + passes * ratio;
    out.forward_seconds *= ratio;
    out.backward_seconds *= ratio;
    out.first_pass_seconds *= ratio;
    out.offloaded_bytes = scale(profile.offloaded_bytes);
    out
}

/// What ran in a logging interval.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IntervalFigures {
    /// Steps decided.
    pub steps: usize,
    /// Segment entries that kept their activations.
    pub kept: usize,
    /// Segment entries checkpointed (recomputed in backward).
    pub recomputed: usize,
    /// Of those, the ones the plan would have kept and the meter's reading turned.
    pub turned: usize,
    /// Of the recomputed, those whose inputs waited in host memory (CPU staging): chosen only
    /// where recomputing alone cannot keep the budget.
    pub offloaded: usize,
    /// The highest measured step peak.
    pub highest_peak: u64,
    /// The budget, in bytes.
    pub budget: u64,
    /// The least a step takes at the first profile's input with every segment recomputed; and
    /// with their inputs in host memory too, where CPU staging can save something.
    pub floor: u64,
    /// See `floor`.
    pub floor_offloaded: Option<u64>,
    /// Per input size (the first segment's input shape): steps, kept, recomputed.
    pub by_size: BTreeMap<String, (usize, usize, usize)>,
}

/// One step's choice.
#[derive(Clone, Debug)]
struct StepChoice {
    size: String,
    ratio: f64,
    /// The profile it was planned from (an index in `Dynamic::profiles`).
    profile: usize,
    /// Whether the step is profiled instead (every segment checkpointed): its size is far from
    /// every profiled one.
    recording: bool,
    checkpointed: Vec<bool>,
    /// Per segment: whether its inputs wait in host memory (it is recomputed too).
    offloaded: Vec<bool>,
    predicted_peak: u64,
    /// Bytes the meter found live beyond the prediction, the most at any entry.
    short: u64,
    /// Bytes the turned segments keep no more.
    covered: u64,
    /// Bytes kept by the segments entered so far.
    kept_so_far: u64,
    /// The segment entries so far.
    calls: usize,
}

/// A profile, at the input size it was taken at.
struct Sized {
    profile: Profile,
    /// Per segment: its first call's input elements.
    elements: Vec<u64>,
    /// Per call: its segment and the live bytes above the step's start at its entry.
    entries: Vec<(usize, u64)>,
    /// Per segment: the float input bytes of its calls (what offloading it takes off the
    /// device).
    inputs: Vec<u64>,
}

/// How far (a factor) a step's input may be from a profiled one's before it is profiled in
/// turn: the prediction scales what grows with the input linearly, which holds near a profile.
pub const PROFILE_SPAN: f64 = 1.25;

/// The window that holds the most in `at`, in words, with its bytes above the weights, state
/// and gradients.
pub fn holds_most(at: &Profile) -> String {
    at.windows
        .iter()
        .max_by_key(|w| w.peak + at.carried(w))
        .map(|w| {
            let held =
                (w.peak + at.carried(w)).saturating_sub(at.resident + at.carried(w) + w.gradients);
            let what = match w.label.as_str() {
                "forward" => "the forward outside every segment (the stem, the input batch, the \
                              outputs the segments pass on)"
                    .to_string(),
                "backward" => "the loss and what backward makes before its first recomputation \
                               (a head or neck outside every segment)"
                    .to_string(),
                "step" => "the optimizer's step".to_string(),
                label => format!("the {label} (one segment's working set)"),
            };
            format!(
                "{what}: {} above the weights, state and gradients",
                human(held)
            )
        })
        .unwrap_or_default()
}

/// How many segments backward brings back from host memory ahead of the one it recomputes
/// (activation offload's default prefetch): their inputs are counted on the device from then.
const PREFETCH: usize = 2;

/// The peak predicted at `at` with every segment checkpointed and those `offloaded` keeping
/// their inputs (`inputs`, bytes per segment) in host memory: off the device at the forward's
/// end but for the last `PREFETCH` segments' (their copies may be under way), in backward
/// until their recomputation is `PREFETCH` segments away.
pub fn floor_offloaded(at: &Profile, inputs: &[u64], offloaded: &[bool]) -> u64 {
    let all = vec![true; at.segments.len()];
    let peaks = at.window_peaks(&all);
    let on_host = |before: usize| -> u64 {
        (0..before)
            .filter(|&i| offloaded.get(i).copied().unwrap_or(false))
            .map(|i| inputs.get(i).copied().unwrap_or(0))
            .sum()
    };
    at.windows
        .iter()
        .zip(peaks)
        .map(|(window, peak)| {
            let off = if window.label == "forward" {
                on_host(at.segments.len().saturating_sub(PREFETCH))
            } else if window.label == "backward" {
                on_host(at.segments.len())
            } else if let Some(path) = window.label.strip_prefix("recompute ") {
                match at.segments.iter().position(|s| s.path == path) {
                    Some(j) => on_host(j.saturating_sub(PREFETCH)),
                    None => 0,
                }
            } else {
                0
            };
            peak.saturating_sub(off)
        })
        .max()
        .unwrap_or(at.resident)
}

/// The segments to offload so that the floor at `at` fits `budget`: the largest inputs first
/// (the fewest copies for the bytes), until it fits; `None` where even all do not.
pub fn choose_offloaded(at: &Profile, inputs: &[u64], budget: u64) -> Option<(Vec<bool>, u64)> {
    let mut offloaded = vec![false; at.segments.len()];
    let mut order: Vec<usize> = (0..at.segments.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(inputs.get(i).copied().unwrap_or(0)));
    let mut peak = floor_offloaded(at, inputs, &offloaded);
    for i in order {
        if peak <= budget {
            break;
        }
        offloaded[i] = true;
        peak = floor_offloaded(at, inputs, &offloaded);
    }
    (peak <= budget).then_some((offloaded, peak))
}

/// The least a step takes at `at`: every segment recomputed, and, `staged`, their inputs in
/// host memory too.
fn least(at: &Profile, inputs: &[u64], staged: bool) -> u64 {
    if staged {
        floor_offloaded(at, inputs, &vec![true; at.segments.len()])
    } else {
        at.floor()
    }
}

/// The state the hook and the run's chooser share.
struct Dynamic {
    meter: Box<dyn Meter>,
    profiling: bool,
    /// Segment identities of the model that runs the step, to their index in the profile (or,
    /// while profiling, to their path).
    ids: HashMap<SegmentId, usize>,
    paths: HashMap<SegmentId, String>,
    /// While profiling: per call in order, the segment, its first input's elements and shape,
    /// and the live bytes above the step's start at its entry.
    /// ... and its float input bytes.
    seen: Vec<(SegmentId, u64, Vec<usize>, u64, u64)>,
    /// The profiles taken, one per input size far enough from the others.
    profiles: Vec<Sized>,
    budget: u64,
    /// What later plans keep below the budget: the most a step's measured peak has exceeded
    /// its prediction; before the first planned step, one segment call's activations.
    margin: u64,
    /// Whether a planned step has measured the margin.
    calibrated: bool,
    live_at_start: u64,
    step: Option<StepChoice>,
    /// A step whose least is over the budget: the error, recorded once.
    below: Option<String>,
    /// Where CPU staging can save something on the run's device: the link's bytes a second
    /// (0: not measured), which prices an offloaded segment's copies.
    staging: Option<f64>,
    interval: IntervalFigures,
    all: IntervalFigures,
}

impl Dynamic {
    fn plan_step(&mut self, index: usize, shape: &[usize], elements: u64) -> StepChoice {
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
fn lock(shared: &Mutex<Dynamic>) -> std::sync::MutexGuard<'_, Dynamic> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// The highest live bytes a recording's events saw.
fn events_peak(events: &[crate::checkpoint::profile::Event]) -> u64 {
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

/// A predicted figure over the input sizes of multi-scale training.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct OverSizes {
    /// The mean predicted step time, seconds.
    pub mean_seconds: f64,
    /// The highest predicted step peak, bytes.
    pub max_peak: u64,
}

/// What `memsave plan` says of a multi-scale config: a static plan made for the largest input
/// against `"dynamic"` and against checkpointing every segment, each predicted over the input
/// sizes the training draws.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MultiScaleComparison {
    /// The budget, bytes.
    pub budget: u64,
    /// How many sizes were drawn, and the smallest's share of the largest's input.
    pub draws: usize,
    /// See `draws`.
    pub smallest_ratio: f64,
    /// The checkpoint set planned for the largest input, predicted at every size (`None`: the
    /// largest does not fit the budget whatever is checkpointed).
    pub static_plan: Option<OverSizes>,
    /// Its segments checkpointed, of how many.
    pub static_checkpointed: (usize, usize),
    /// Each size's own plan (from the nearer profile).
    pub dynamic: OverSizes,
    /// Every segment checkpointed.
    pub all_checkpointed: OverSizes,
}

/// Compares, over input sizes `ratios` (each a share of the largest input's elements), a static
/// plan made for the largest (`largest`, profiled there) with `"dynamic"` (each size planned
/// from the nearer of `largest` and `smaller`, a profile at the share `smaller.1`) and with
/// every segment checkpointed, under `budget` bytes.
pub fn compare_multiscale(
    largest: &Profile,
    smaller: Option<(&Profile, f64)>,
    ratios: &[f64],
    budget: u64,
) -> MultiScaleComparison {
    let nearest = |r: f64| -> Profile {
        match smaller {
            Some((profile, at)) if (r / at).ln().abs() < r.ln().abs() => scaled(profile, r / at),
            _ => scaled(largest, r),
        }
    };
    let n = largest.segments.len();
    let all = vec![true; n];
    let fixed = plan(largest, budget).ok().map(|p| p.checkpointed);
    let (mut dynamic, mut every, mut fixed_over) = (Vec::new(), Vec::new(), Vec::new());
    for &r in ratios {
        let at = nearest(r);
        let chosen = plan(&at, budget)
            .map(|p| p.checkpointed)
            .unwrap_or_else(|_| all.clone());
        dynamic.push((at.predict_seconds(&chosen), at.predict_peak(&chosen)));
        every.push((at.predict_seconds(&all), at.predict_peak(&all)));
        if let Some(set) = &fixed {
            fixed_over.push((at.predict_seconds(set), at.predict_peak(set)));
        }
    }
    let over = |figures: &[(f64, u64)]| OverSizes {
        mean_seconds: figures.iter().map(|f| f.0).sum::<f64>() / figures.len().max(1) as f64,
        max_peak: figures.iter().map(|f| f.1).max().unwrap_or(0),
    };
    MultiScaleComparison {
        budget,
        draws: ratios.len(),
        smallest_ratio: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        static_plan: fixed.as_ref().map(|_| over(&fixed_over)),
        static_checkpointed: (
            fixed
                .as_ref()
                .map_or(n, |f| f.iter().filter(|c| **c).count()),
            n,
        ),
        dynamic: over(&dynamic),
        all_checkpointed: over(&every),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{SegmentProfile, Window};

    /// Two segments of 100 bytes kept each, 1 s of recomputation each, over 1000 resident.
    fn profile() -> Profile {
        let segment = |path: &str| SegmentProfile {
            path: path.into(),
            kind: "Block".into(),
            kept_bytes: 100,
            output_bytes: 10,
            forward_seconds: 1.0,
            recompute_seconds: 1.0,
            calls: 1,
        };
        let window = |label: &str, peak: u64, alive: Vec<(usize, u64)>| Window {
            label: label.into(),
            peak,
            gradients: 0,
            batch_scaled: true,
            alive,
            recomputed: Vec::new(),
            state_made: 0,
        };
        Profile {
            resident: 1000,
            trainable: 0,
            gradients: 0,
            growth: 0,
            step_seconds: 10.0,
            helper_bytes: 0,
            segments: vec![segment("a"), segment("b")],
            unplannable: Vec::new(),
            windows: vec![
                window("forward", 1050, vec![(0, 100), (1, 100)]),
                window("backward", 1050, vec![(0, 100), (1, 100)]),
            ],
            gradients_estimated: false,
            forward_seconds: 4.0,
            backward_seconds: 6.0,
            passes: 1,
            first_pass_seconds: 0.0,
            offloaded_bytes: 0,
            host_step_seconds: 0.0,
            link_bytes_per_second: 0.0,
        }
    }

    #[test]
    fn offloading_takes_the_inputs_off_where_they_wait_and_the_largest_first() {
        // Four segments in forward order, inputs of 40, 10, 30, 20 bytes; with every one
        // recomputed the backward window peaks at 1300 and each recomputation lower.
        let mut at = profile();
        let segment = at.segments[0].clone();
        at.segments = ["a", "b", "c", "d"]
            .iter()
            .map(|path| SegmentProfile {
                path: path.to_string(),
                ..segment.clone()
            })
            .collect();
        let window = |label: &str, peak: u64| Window {
            label: label.into(),
            peak,
            gradients: 0,
            batch_scaled: true,
            alive: Vec::new(),
            recomputed: Vec::new(),
            state_made: 0,
        };
        at.windows = vec![
            window("forward", 1200),
            window("backward", 1300),
            window("recompute d", 1250),
            window("recompute c", 1200),
            window("recompute b", 1150),
            window("recompute a", 1100),
            window("step", 1050),
        ];
        let inputs = [40, 10, 30, 20];
        let none = [false; 4];
        assert_eq!(floor_offloaded(&at, &inputs, &none), 1300);
        // All offloaded: the forward without all but the last two (1200 - 50), backward
        // without all four (1200); recomputing d, a is still away (b comes back before:
        // 1250 - 40), recomputing c, nothing (1200).
        let all = [true; 4];
        assert_eq!(floor_offloaded(&at, &inputs, &all), 1210);
        // To fit 1260: a (the largest input) is enough: 1300 - 40.
        let (chosen, peak) = choose_offloaded(&at, &inputs, 1260).unwrap();
        assert_eq!(chosen, [true, false, false, false]);
        assert_eq!(peak, 1260);
        // To fit 1230: a, then c: the backward at 1230, the recomputation of d at 1210.
        let (chosen, peak) = choose_offloaded(&at, &inputs, 1230).unwrap();
        assert_eq!(chosen, [true, false, true, false]);
        assert_eq!(peak, 1230);
        // Below what every input in host memory gives: none.
        assert!(choose_offloaded(&at, &inputs, 1209).is_none());
    }

    #[test]
    fn a_profile_scales_what_grows_with_the_input_and_keeps_the_rest() {
        let at = scaled(&profile(), 0.5);
        assert_eq!(
            at.windows[0].peak, 1025,
            "the resident 1000 kept, the 50 above halved"
        );
        assert_eq!(at.windows[0].alive, vec![(0, 50), (1, 50)]);
        assert_eq!(at.segments[0].kept_bytes, 50);
        assert_eq!(at.segments[0].recompute_seconds, 0.5);
        assert_eq!(at.step_seconds, 5.0);
        assert_eq!(at.unplanned_peak(), 1125);
    }

    #[test]
    fn a_static_plan_for_the_largest_input_recomputes_at_every_size_and_dynamic_does_not() {
        let largest = profile();
        // Unplanned at the largest: 1250; with one checkpointed: 1150; both: 1050.
        assert_eq!(largest.unplanned_peak(), 1250);
        let budget = 1150;
        // Half the draws at the largest, half at a quarter of it (unplanned 1062: all kept).
        let ratios = [1.0, 0.25, 1.0, 0.25];
        let compared = compare_multiscale(&largest, None, &ratios, budget);
        let fixed = compared.static_plan.unwrap();
        assert_eq!(compared.static_checkpointed, (1, 2));
        // The static plan recomputes one segment at every size (10 - 1 s at the largest, 2.5 -
        // 0.25 at a quarter); dynamic only at the largest (a quarter: 2.5 - 0.5, nothing
        // recomputed).
        assert!(
            (fixed.mean_seconds - (9.0 + 2.25) / 2.0).abs() < 1e-9,
            "{fixed:?}"
        );
        assert!(
            (compared.dynamic.mean_seconds - (9.0 + 2.0) / 2.0).abs() < 1e-9,
            "{compared:?}"
        );
        assert!(compared.dynamic.mean_seconds < fixed.mean_seconds);
        assert!(compared.dynamic.max_peak <= budget && fixed.max_peak <= budget);
        assert!(compared.all_checkpointed.mean_seconds > fixed.mean_seconds);
        // Below the least at the largest: no static plan.
        let tight = compare_multiscale(&largest, None, &ratios, 1000);
        assert_eq!(tight.static_plan, None);
    }
}
