//! `with_cp = "dynamic"`: a memory budget kept while each step runs, at any input size (the
//! source article's "dynamic memory optimisation", MegEngine's DTR, made exact and per segment).
//!
//! The run's first step is profiled with every segment checkpointed ([`ProfileHook`]), at the
//! input size it has; each segment's first input size is kept with it. From then on each step
//! is decided as it runs, at its first segment's entry ([`crate::checkpoint::dynamic`]):
//! - the step's size is that input's over the profiled one (`ratio`); the profile is predicted
//!   at it (what grows with the input scaled, the weights, state and gradients not);
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

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::AutodiffBackend;

use super::auto::note;
use super::profile_hook::{segment_ids, set_flags, ProfileHook};
use super::{plan, Budget, ModelKeys, Profile};
use crate::checkpoint::dynamic::{set_chooser, Chooser, SharedChooser};
use crate::checkpoint::{CheckpointModule, SegmentId};
use crate::memory::{human, meter_for, Meter};
use crate::train::{Hook, TrainModel, TrainState};
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
    /// The highest measured step peak.
    pub highest_peak: u64,
    /// The budget, in bytes.
    pub budget: u64,
    /// Per input size (the first segment's input shape): steps, kept, recomputed.
    pub by_size: BTreeMap<String, (usize, usize, usize)>,
}

/// One step's choice.
#[derive(Clone, Debug)]
struct StepChoice {
    size: String,
    ratio: f64,
    checkpointed: Vec<bool>,
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
    seen: Vec<(SegmentId, u64, Vec<usize>, u64)>,
    profile: Option<Profile>,
    /// Per profiled segment: its first call's input elements.
    elements: Vec<u64>,
    /// Per profiled call: its segment and the live bytes above the step's start at its entry.
    entries: Vec<(usize, u64)>,
    budget: u64,
    margin: u64,
    live_at_start: u64,
    step: Option<StepChoice>,
    /// A step whose least is over the budget: the error, recorded once.
    below: Option<String>,
    interval: IntervalFigures,
    all: IntervalFigures,
}

impl Dynamic {
    fn plan_step(&mut self, index: usize, shape: &[usize], elements: u64) -> StepChoice {
        let profile = self.profile.as_ref().expect("planned after the profile");
        let ratio = elements as f64 / self.elements[index].max(1) as f64;
        let at = scaled(profile, ratio);
        // What the meter read at the step's start beyond the profiled start and the state the
        // first step made (a larger batch's own bytes): in every window.
        let shift = self
            .live_at_start
            .saturating_sub(profile.resident + profile.growth);
        let budget = self.budget.saturating_sub(self.margin + shift);
        let size = format!("{shape:?}");
        // Under the margin nothing fits, and without it the least does: the least, then.
        let floor = at.floor() + shift;
        let planned = match plan(&at, budget) {
            Err(_) if floor <= self.budget => {
                let all = vec![true; at.segments.len()];
                Ok(super::Plan {
                    paths: at.segments.iter().map(|s| s.path.clone()).collect(),
                    peak: floor - shift,
                    seconds: at.predict_seconds(&all),
                    checkpointed: all,
                    exact: false,
                })
            }
            planned => planned,
        };
        match planned {
            Ok(plan) => StepChoice {
                size,
                ratio,
                predicted_peak: plan.peak + shift,
                checkpointed: plan.checkpointed,
                short: 0,
                covered: 0,
                kept_so_far: 0,
                calls: 0,
            },
            Err(below) => {
                let all = vec![true; at.segments.len()];
                // The window holding the most at the least checkpointing gives.
                let worst = at
                    .windows
                    .iter()
                    .max_by_key(|w| w.peak + at.carried(w))
                    .map(|w| {
                        let held = (w.peak + at.carried(w))
                            .saturating_sub(at.resident + at.carried(w) + w.gradients);
                        let what = match w.label.as_str() {
                            "forward" => "the forward outside every segment (the stem, the \
                                          input batch, the outputs the segments pass on)"
                                .to_string(),
                            "backward" => "the loss and what backward makes before its first \
                                           recomputation (a head or neck outside every segment)"
                                .to_string(),
                            "step" => "the optimizer's step".to_string(),
                            label => format!("the {label} (one segment's working set)"),
                        };
                        format!(
                            "{what}: {} above the weights, state and gradients",
                            human(held)
                        )
                    })
                    .unwrap_or_default();
                self.below = Some(format!(
                    "at this input size (a first segment input of shape {size}, {ratio:.2}x the \
                     profiled one), one step with every segment checkpointed is predicted to \
                     peak at {} (the weights, optimizer state and gradients {} of it), above \
                     the memory budget of {}{}. What holds the most is {worst}; no choice of \
                     segments frees it. Lower the largest input (the pipeline's `img_scale`) or \
                     the batch, put more of the model in segments, or switch on mixed \
                     precision or 8-bit optimizer state",
                    human(below.floor + shift),
                    human(at.resident + at.growth + at.trainable),
                    human(self.budget),
                    if self.margin > 0 {
                        format!(
                            " less the {} earlier steps ran over their prediction",
                            human(self.margin)
                        )
                    } else {
                        String::new()
                    }
                ));
                StepChoice {
                    size,
                    ratio,
                    predicted_peak: below.floor + shift,
                    checkpointed: all,
                    short: 0,
                    covered: 0,
                    kept_so_far: 0,
                    calls: 0,
                }
            }
        }
    }
}

impl Chooser for Dynamic {
    fn choose(&mut self, id: SegmentId, shape: &[usize]) -> Option<bool> {
        let elements: u64 = shape.iter().map(|&d| d as u64).product();
        if self.profiling {
            let above = self.meter.live().saturating_sub(self.live_at_start);
            self.seen.push((id, elements, shape.to_vec(), above));
            return None;
        }
        let index = *self.ids.get(&id)?;
        self.profile.as_ref()?;
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
        let profile = self.profile.as_ref()?;
        let live = self.meter.live();
        let step = self.step.as_mut()?;
        let call = step.calls;
        step.calls += 1;
        let per_call = |i: usize| {
            let segment = &profile.segments[i];
            (segment.kept_bytes as f64 * step.ratio / segment.calls.max(1) as f64) as u64
        };
        // The meter against the prediction at this entry.
        if let Some(&(profiled, above)) = self.entries.get(call) {
            if profiled == index {
                let predicted =
                    self.live_at_start + (above as f64 * step.ratio) as u64 + step.kept_so_far;
                step.short = step.short.max(live.saturating_sub(predicted));
            }
        }
        let mut checkpointed = step.checkpointed.get(index).copied().unwrap_or(true);
        let turned = !checkpointed && step.short > step.covered;
        if turned {
            checkpointed = true;
            step.covered += per_call(index);
        }
        if !checkpointed {
            step.kept_so_far += per_call(index);
        }
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
        }
        Some(checkpointed)
    }
}

/// `with_cp = "dynamic"` in training (see the [module docs](self)): profiles the run's first
/// step, then keeps `budget` in every later one, segment by segment, at any input size.
pub struct DynamicHook {
    budget: Budget,
    keys: ModelKeys,
    profile: ProfileHook,
    shared: Arc<Mutex<Dynamic>>,
    interval: usize,
    figures: Rc<RefCell<IntervalFigures>>,
}

/// The shared state, as the hook reads it.
fn lock(shared: &Mutex<Dynamic>) -> std::sync::MutexGuard<'_, Dynamic> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

impl DynamicHook {
    /// Keeps `budget` on `device`; `keys` name the model's settings in errors.
    pub fn new<D: 'static>(budget: Budget, keys: ModelKeys, device: &D) -> Result<Self> {
        let no_meter = || {
            Error::invalid(
                keys.with_cp,
                format!(
                    "\"dynamic\" reads the memory in use as each step runs, and the device `{}` \
                     has no meter memsave can read: memsave's counting allocator is not this \
                     program's global allocator (see memsave::memory), and the device is not a \
                     CubeCL one (CUDA, wgpu)",
                    std::any::type_name::<D>()
                ),
            )
        };
        let meter = meter_for(device).ok_or_else(no_meter)?;
        Ok(DynamicHook {
            budget,
            keys,
            profile: ProfileHook::new(usize::MAX, meter_for(device).ok_or_else(no_meter)?),
            shared: Arc::new(Mutex::new(Dynamic {
                meter,
                profiling: false,
                ids: HashMap::new(),
                paths: HashMap::new(),
                seen: Vec::new(),
                profile: None,
                elements: Vec::new(),
                entries: Vec::new(),
                budget: 0,
                margin: 0,
                live_at_start: 0,
                step: None,
                below: None,
                interval: IntervalFigures::default(),
                all: IntervalFigures::default(),
            })),
            interval: 50,
            figures: Rc::new(RefCell::new(IntervalFigures::default())),
        })
    }

    /// Reports the choices every `interval` iterations (the log's interval).
    pub fn with_log_interval(mut self, interval: usize) -> Self {
        self.interval = interval.max(1);
        self
    }

    /// The profile and the budget in bytes, once profiled.
    pub fn profiled(&self) -> Option<(Profile, u64)> {
        let shared = lock(&self.shared);
        shared.profile.clone().map(|p| (p, shared.budget))
    }

    /// The figures of the whole run so far (shared, for reading after the run).
    pub fn figures(&self) -> Rc<RefCell<IntervalFigures>> {
        self.figures.clone()
    }

    fn take_ids<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule>(
        &self,
        state: &TrainState<B, M>,
    ) {
        let mut shared = lock(&self.shared);
        let paths = segment_ids(state.forward_model());
        let ids = match &shared.profile {
            Some(profile) => paths
                .iter()
                .filter_map(|(id, path)| {
                    let index = profile.segments.iter().position(|s| &s.path == path)?;
                    Some((*id, index))
                })
                .collect(),
            None => HashMap::new(),
        };
        shared.ids = ids;
        shared.paths = paths;
    }
}

impl<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule> Hook<B, M> for DynamicHook {
    fn name(&self) -> &'static str {
        "dynamic"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.profile.iter = state.iter;
        set_flags(state, &|_| true);
        let chooser: SharedChooser = self.shared.clone();
        set_chooser(Some(chooser));
        Ok(())
    }

    fn after_run(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        set_chooser(None);
        Ok(())
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.profile.iter {
            self.profile.begin(state);
            let mut shared = lock(&self.shared);
            shared.paths = segment_ids(state.forward_model());
            shared.profiling = true;
            shared.seen.clear();
            shared.live_at_start = shared.meter.live();
            return Ok(());
        }
        self.take_ids(state);
        let mut shared = lock(&self.shared);
        shared.step = None;
        shared.live_at_start = shared.meter.live();
        shared.meter.window_peak();
        Ok(())
    }

    fn after_first_pass(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.profile.iter {
            self.profile.first_pass_done(state);
            let mut shared = lock(&self.shared);
            shared.seen.clear();
            shared.paths = segment_ids(state.forward_model());
        } else {
            // The second forward runs on the model the optimizer hook made for it: the same
            // choices, by segment.
            self.take_ids(state);
            if let Some(step) = lock(&self.shared).step.as_mut() {
                step.calls = 0;
                step.kept_so_far = 0;
            }
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.profile.iter {
            if self.profile.skipped(state) {
                return Ok(());
            }
            let profile = self.profile.end(state);
            let unplanned = profile.unplanned_peak();
            let budget = self.budget.bytes(unplanned);
            let mut shared = lock(&self.shared);
            shared.profiling = false;
            // Each profiled segment's first input, and each call's entry.
            let index_of = |shared: &Dynamic, id: &SegmentId| {
                let path = shared.paths.get(id)?;
                profile.segments.iter().position(|s| &s.path == path)
            };
            let mut elements = vec![0; profile.segments.len()];
            let mut entries = Vec::new();
            for (id, count, _, above) in &shared.seen {
                if let Some(index) = index_of(&shared, id) {
                    if elements[index] == 0 {
                        elements[index] = *count;
                    }
                    entries.push((index, *above));
                }
            }
            let floor = profile.floor();
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
                        "the least a step takes at the profiled input, every segment \
                         checkpointed (`{}`), is {} (weights, state and data {}); a larger input \
                         takes more. Lower the input's size or the batch (`{}`), put more of the \
                         model in segments, or switch on mixed precision or 8-bit optimizer \
                         state",
                        self.keys.with_cp,
                        human(floor),
                        human(weights),
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
            note(
                state,
                &format!(
                    "dynamic: budget {} ({}); profiled at a first input of {:?}: peak {} without \
                     checkpointing, {} with every one of {} segments checkpointed",
                    human(budget),
                    self.budget,
                    shared.seen.first().map(|s| s.2.clone()).unwrap_or_default(),
                    human(unplanned),
                    human(floor),
                    profile.segments.len(),
                ),
            );
            shared.budget = budget;
            shared.elements = elements;
            shared.entries = entries;
            shared.profile = Some(profile);
            return Ok(());
        }
        let mut shared = lock(&self.shared);
        if shared.profile.is_none() {
            return Ok(());
        }
        let measured = shared.meter.window_peak();
        let budget = shared.budget;
        if let Some(step) = shared.step.take() {
            let inner = &mut *shared;
            for figures in [&mut inner.interval, &mut inner.all] {
                figures.steps += 1;
                figures.highest_peak = figures.highest_peak.max(measured);
                figures.budget = budget;
                figures.by_size.entry(step.size.clone()).or_default().0 += 1;
            }
            if measured > step.predicted_peak {
                let error = measured - step.predicted_peak;
                if error > shared.margin {
                    shared.margin = error;
                }
            }
            if measured > budget {
                let margin = shared.margin;
                drop(shared);
                note(
                    state,
                    &format!(
                        "dynamic: step {} at {} peaked at {}, over the budget {} (predicted {}); \
                         the next steps plan {} lower",
                        state.iter + 1,
                        step.size,
                        human(measured),
                        human(budget),
                        human(step.predicted_peak),
                        human(margin)
                    ),
                );
                shared = lock(&self.shared);
            }
        }
        *self.figures.borrow_mut() = shared.all.clone();
        if state.every_n_iters(self.interval) || state.is_last_iter() {
            let figures = std::mem::take(&mut shared.interval);
            drop(shared);
            if figures.steps > 0 {
                let sizes: Vec<String> = figures
                    .by_size
                    .iter()
                    .map(|(size, (steps, kept, recomputed))| {
                        format!("{size}: {steps} steps, kept {kept}, recomputed {recomputed}")
                    })
                    .collect();
                note(
                    state,
                    &format!(
                        "dynamic: iters up to {}: segments kept {}, recomputed {} ({} of them \
                         turned by the meter); highest step peak {} of the budget {}; by input: \
                         {}",
                        state.iter + 1,
                        figures.kept,
                        figures.recomputed,
                        figures.turned,
                        human(figures.highest_peak),
                        human(budget),
                        sizes.join("; ")
                    ),
                );
            }
        }
        Ok(())
    }
}
