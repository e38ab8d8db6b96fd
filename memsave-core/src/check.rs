//! The check a user runs on their own model: checkpointing (and, if asked, half precision)
//! changes the gradients by nothing (half: by its rounding) and lowers the memory, measured.
//!
//! It does what memsave's own tests do, in one call:
//! - it materialises every parameter first: Burn initialises lazily, so two clones of a fresh
//!   model would otherwise get different weights, and a with/without comparison would differ
//!   for that reason alone;
//! - it reseeds the backend before each pass, so dropout draws the same masks;
//! - it runs one forward and backward without checkpointing and one with every `#[with_cp]`
//!   segment checkpointed (and the same two in half precision), and compares each parameter's
//!   gradient;
//! - it records which segments ran checkpointed, how often each was recomputed in backward,
//!   and the bytes each kept for backward with and without checkpointing, and reads the step's
//!   peak from the one [`Meter`] (the counting allocator on the CPU, the pools on a device).
//!
//! ```ignore
//! let report = memsave::check::check_model(model, |model| model.loss(images.clone(), labels.clone()))?;
//! println!("{report}");
//! assert!(report.worst_difference() == 0.0);
//! ```

use std::collections::HashMap;
use std::fmt;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;

use crate::checkpoint::profile::{self, Event};
use crate::checkpoint::{join_helpers, set_with_cp, CheckpointModule, SegmentId};
use crate::fp16::{wrap_fp16_model, Fp16Module, Precision};
use crate::memory::{self, Meter};
use crate::{Error, Result};

/// What to run: the seed drawn before each pass, and the half precision to compare (with the
/// static loss scale its backward runs at).
#[derive(Clone, Debug)]
pub struct ModelCheck {
    /// Drawn by the backend before each pass (dropout's masks).
    pub seed: u64,
    /// The half precision to compare against fp32, if any.
    pub precision: Option<Precision>,
    /// The loss is multiplied by this before a half backward and the gradients divided back
    /// (MMCV's static 512), so that small f16 gradients do not flush to zero.
    pub loss_scale: f64,
}

impl Default for ModelCheck {
    fn default() -> Self {
        ModelCheck {
            seed: 42,
            precision: None,
            loss_scale: crate::scaler::MMCV_STATIC_SCALE,
        }
    }
}

/// One pass: its loss, its gradients and its memory.
#[derive(Clone, Debug, PartialEq)]
pub struct PassReport {
    /// `fp32` or the half precision, and `plain` or `checkpointed`.
    pub name: String,
    /// The loss, as fp32.
    pub loss: f64,
    /// The step's peak above its start (forward and backward), where a meter can be read.
    pub peak_bytes: Option<u64>,
    /// Bytes live after the forward beyond the start: what was kept for backward.
    pub kept_bytes: Option<u64>,
    /// The worst relative gradient difference against the reference pass (0 for the
    /// reference): over parameters, `max |a - b| / max |b|`.
    pub difference: f64,
    /// The parameter where it is, by module path (`backbone.layer1.0.conv1.weight`).
    pub worst_parameter: Option<String>,
    /// The pass it was compared with.
    pub against: String,
}

/// One `#[with_cp]` segment.
#[derive(Clone, Debug, PartialEq)]
pub struct SegmentReport {
    /// Its module path.
    pub path: String,
    /// Its type (`Bottleneck`).
    pub type_name: String,
    /// Whether it ran checkpointed (and was recomputed in backward). A segment whose input is
    /// not in the autodiff graph (MMCV's guard: the network's first layer), or that a tracked
    /// tensor enters other than as its input or a parameter (one captured by the closure, or
    /// held in a bare `Tensor` field), runs plainly, exact but saving nothing.
    pub checkpointed: bool,
    /// Why it ran plainly, when it did.
    pub why_plain: Option<String>,
    /// Times its forward was recomputed in the checkpointed fp32 pass's backward.
    pub recomputed: usize,
    /// Bytes its forward left live without checkpointing (what it keeps for backward plus its
    /// output), where a meter can be read.
    pub kept_plain: Option<u64>,
    /// The same with checkpointing (its output only).
    pub kept_checkpointed: Option<u64>,
}

impl SegmentReport {
    /// Bytes checkpointing saved in this segment's forward.
    pub fn saved(&self) -> Option<i64> {
        Some(self.kept_plain? as i64 - self.kept_checkpointed? as i64)
    }
}

/// What [`check_model`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckReport {
    /// The passes: fp32 plain (the reference), fp32 checkpointed, then the half ones.
    pub passes: Vec<PassReport>,
    /// The segments, in field order.
    pub segments: Vec<SegmentReport>,
    /// What measured the memory, or why nothing did.
    pub meter: String,
}

impl CheckReport {
    /// The worst gradient difference checkpointing made, in fp32 or in half (each against
    /// the same precision without checkpointing); half against fp32 is not counted.
    pub fn worst_difference(&self) -> f64 {
        self.passes
            .iter()
            .filter(|pass| pass.name.ends_with("checkpointed"))
            .map(|pass| pass.difference)
            .fold(0.0, |worst, d| {
                if d.is_nan() || worst.is_nan() {
                    f64::NAN
                } else {
                    worst.max(d)
                }
            })
    }

    /// The pass named `name` (`fp32 checkpointed`, `f16 plain`, ...).
    pub fn pass(&self, name: &str) -> Option<&PassReport> {
        self.passes.iter().find(|pass| pass.name == name)
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = |b: Option<u64>| b.map_or("-".to_string(), memory::human);
        writeln!(f, "memsave check (memory: {})", self.meter)?;
        writeln!(
            f,
            "  {:<18} {:>12} {:>11} {:>11} {:>11}  against",
            "pass", "loss", "peak", "kept", "grad diff"
        )?;
        for pass in &self.passes {
            write!(
                f,
                "  {:<18} {:>12.6} {:>11} {:>11} {:>11.3e}",
                pass.name,
                pass.loss,
                bytes(pass.peak_bytes),
                bytes(pass.kept_bytes),
                pass.difference
            )?;
            if !pass.against.is_empty() {
                write!(f, "  {}", pass.against)?;
                if let Some(worst) = &pass.worst_parameter {
                    if pass.difference > 0.0 {
                        write!(f, " (worst: {worst})")?;
                    }
                }
            }
            writeln!(f)?;
        }
        if self.segments.is_empty() {
            writeln!(
                f,
                "  no checkpointed segment: mark the blocks to recompute with #[with_cp] (a \
                 field of the model, or a method of a #[memsave::model] block)"
            )?;
        }
        for segment in &self.segments {
            let saved = segment
                .saved()
                .map_or("-".to_string(), |s| memory::human(s.max(0) as u64));
            if let Some(why) = &segment.why_plain {
                writeln!(
                    f,
                    "  segment {} ({}): ran plainly, saving nothing: {why}",
                    segment.path, segment.type_name
                )?;
                continue;
            }
            writeln!(
                f,
                "  segment {} ({}): recomputed {}x, kept {} -> {}, saved {}",
                segment.path,
                segment.type_name,
                segment.recomputed,
                bytes(segment.kept_plain),
                bytes(segment.kept_checkpointed),
                saved
            )?;
        }
        Ok(())
    }
}

/// The types in `model` whose `with_cp` flag is on but for which no `#[with_cp]` method has
/// run (a block whose forward is not marked): call it after a forward pass. Each is named once,
/// short (`Block`); [`crate::checkpoint::no_segment_message`] says what to do.
pub fn switched_on_without_segment<M: Fp16Module>(model: &M) -> Vec<String> {
    crate::checkpoint::unreached(|visit| model.visit_with_cp_flags(visit))
}

/// [`ModelCheck::run`] with the defaults (fp32 only, seed 42).
pub fn check_model<B, M, L>(model: M, loss: L) -> Result<CheckReport>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + CheckpointModule,
    L: Fn(&M) -> Tensor<B, 1>,
{
    ModelCheck::default().run(model, loss)
}

impl ModelCheck {
    /// Also compares half precision (`Precision::F16` or `Bf16`) with and without
    /// checkpointing, and against fp32.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = Some(precision);
        self
    }

    /// Runs the fp32 passes (see the module's text); `loss` computes the mean loss of the
    /// user's batch from a model.
    pub fn run<B, M, L>(&self, model: M, loss: L) -> Result<CheckReport>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + CheckpointModule,
        L: Fn(&M) -> Tensor<B, 1>,
    {
        if self.precision.is_some() {
            return Err(Error::invalid(
                "precision",
                "comparing half precision needs a model that can be wrapped for it: call \
                 `ModelCheck::run_with_fp16` (the model must implement `Fp16Module`, as \
                 #[memsave::model] makes it)",
            ));
        }
        let model = materialise(model);
        let mut runner = Passes::new(self, &model);
        runner.pair("fp32", &model, &loss, 1.0)?;
        Ok(runner.report())
    }

    /// [`ModelCheck::run`], with the half passes of [`ModelCheck::with_precision`] (F16 if it
    /// was not called).
    pub fn run_with_fp16<B, M, L>(&self, model: M, loss: L) -> Result<CheckReport>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + CheckpointModule + Fp16Module,
        L: Fn(&M) -> Tensor<B, 1>,
    {
        if !(self.loss_scale.is_finite() && self.loss_scale > 0.0) {
            return Err(Error::invalid(
                "loss_scale",
                format!("must be a positive finite number, got {}", self.loss_scale),
            ));
        }
        let precision = self.precision.unwrap_or(Precision::F16);
        let model = materialise(model);
        let mut runner = Passes::new(self, &model);
        runner.pair("fp32", &model, &loss, 1.0)?;
        let half = wrap_fp16_model(model, precision);
        let name = match precision {
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        };
        runner.pair(name, &half, &loss, self.loss_scale)?;
        let reference = runner.passes[0].0.name.clone();
        let gradients = runner.passes[0].1.clone();
        let (difference, worst) = relative_difference(&runner.passes[2].1, &gradients);
        let (plain_half, _) = &mut runner.passes[2];
        plain_half.difference = difference;
        plain_half.worst_parameter =
            worst.map(|id| runner.names.get(&id).cloned().unwrap_or_default());
        plain_half.against = reference;
        Ok(runner.report())
    }
}

/// The passes run so far, with their gradients.
struct Passes<'a> {
    check: &'a ModelCheck,
    meter: Option<Box<dyn Meter>>,
    meter_name: String,
    names: HashMap<ParamId, String>,
    passes: Vec<(PassReport, HashMap<ParamId, Vec<f32>>)>,
    segments: Vec<SegmentReport>,
}

impl<'a> Passes<'a> {
    fn new<B: AutodiffBackend, M: AutodiffModule<B>>(check: &'a ModelCheck, model: &M) -> Self {
        let device = model.devices().into_iter().next().unwrap_or_default();
        let meter = memory::meter_for(&device);
        let meter_name = match &meter {
            Some(meter) if meter.reserved().is_some() => "the device's memory pools".to_string(),
            Some(_) => "memsave's counting allocator".to_string(),
            None => "not measured: on the CPU, install memsave::memory::CountingAllocator as \
                     the #[global_allocator]"
                .to_string(),
        };
        Passes {
            check,
            meter,
            meter_name,
            names: param_names(model),
            passes: Vec::new(),
            segments: Vec::new(),
        }
    }

    /// The plain and the checkpointed pass of `model` in one precision.
    fn pair<B, M, L>(&mut self, precision: &str, model: &M, loss: &L, scale: f64) -> Result<()>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + CheckpointModule,
        L: Fn(&M) -> Tensor<B, 1>,
    {
        let plain = set_with_cp(model.clone(), false);
        let checkpointed = set_with_cp(model.clone(), true);
        let (plain_report, plain_grads, plain_events) =
            self.pass(format!("{precision} plain"), &plain, loss, scale)?;
        let (mut cp_report, cp_grads, cp_events) = self.pass(
            format!("{precision} checkpointed"),
            &checkpointed,
            loss,
            scale,
        )?;
        let (difference, worst) = relative_difference(&cp_grads, &plain_grads);
        cp_report.difference = difference;
        cp_report.worst_parameter =
            worst.map(|id| self.names.get(&id).cloned().unwrap_or_default());
        cp_report.against = plain_report.name.clone();
        if self.segments.is_empty() {
            self.segments = segments(
                &plain,
                &plain_events,
                &checkpointed,
                &cp_events,
                self.meter.is_some(),
            );
        }
        self.passes.push((plain_report, plain_grads));
        self.passes.push((cp_report, cp_grads));
        Ok(())
    }

    /// One forward and backward of `model`, reseeded, recorded.
    fn pass<B, M, L>(
        &self,
        name: String,
        model: &M,
        loss: &L,
        scale: f64,
    ) -> Result<(PassReport, HashMap<ParamId, Vec<f32>>, Vec<Event>)>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        L: Fn(&M) -> Tensor<B, 1>,
    {
        let device = model.devices().into_iter().next().unwrap_or_default();
        if profile::is_recording() {
            return Err(Error::invalid(
                "check",
                "a profile is being recorded in this process (the planner's): run the check \
                 on its own",
            ));
        }
        let start = self.meter.as_ref().map(|meter| meter.reset_peak());
        profile::start(match &self.meter {
            Some(_) => memory::meter_for(&device).unwrap_or_else(|| Box::new(Blind)),
            None => Box::new(Blind),
        });
        B::seed(&device, self.check.seed);
        let value = loss(model);
        let kept = match (&self.meter, start) {
            (Some(meter), Some(start)) => Some(meter.live().saturating_sub(start)),
            _ => None,
        };
        let value_f64 = value
            .clone()
            .cast(DType::F32)
            .into_data()
            .to_vec::<f32>()
            .map_err(|e| Error::Data(format!("the loss could not be read: {e:?}")))?;
        if value_f64.len() != 1 {
            let _ = profile::stop();
            return Err(Error::invalid(
                "loss",
                format!(
                    "the loss closure must return one value (the mean loss), got {} values",
                    value_f64.len()
                ),
            ));
        }
        let grads = if scale == 1.0 {
            value.backward()
        } else {
            value.mul_scalar(scale).backward()
        };
        join_helpers();
        let peak = match (&self.meter, start) {
            (Some(meter), Some(start)) => Some(meter.peak().saturating_sub(start)),
            _ => None,
        };
        let events = profile::stop();
        let mut gradients = gradients(model, &grads);
        if scale != 1.0 {
            for values in gradients.values_mut() {
                values.iter_mut().for_each(|v| *v /= scale as f32);
            }
        }
        let report = PassReport {
            name,
            loss: value_f64[0] as f64,
            peak_bytes: peak,
            kept_bytes: kept,
            difference: 0.0,
            worst_parameter: None,
            against: String::new(),
        };
        Ok((report, gradients, events))
    }

    fn report(self) -> CheckReport {
        CheckReport {
            passes: self.passes.into_iter().map(|(report, _)| report).collect(),
            segments: self.segments,
            meter: self.meter_name,
        }
    }
}

/// A meter that reads nothing, for a recording that only counts.
struct Blind;

impl Meter for Blind {
    fn live(&self) -> u64 {
        0
    }
    fn reset_peak(&self) -> u64 {
        0
    }
    fn peak(&self) -> u64 {
        0
    }
    fn window_peak(&self) -> u64 {
        0
    }
}

/// Each segment of the two models, matched by path, with what the two recordings say of it.
fn segments<M: CheckpointModule>(
    plain: &M,
    plain_events: &[Event],
    checkpointed: &M,
    cp_events: &[Event],
    measured: bool,
) -> Vec<SegmentReport> {
    let ids = |model: &M| {
        let mut ids = Vec::new();
        model.visit_segments("", &mut |path, id| ids.push((path.to_string(), id)));
        ids
    };
    let kept = |events: &[Event], wanted: SegmentId| {
        events.iter().find_map(|event| match event {
            Event::Forward {
                id, before, after, ..
            } if *id == wanted => Some(after.saturating_sub(*before)),
            _ => None,
        })
    };
    let plain_ids: HashMap<String, SegmentId> = ids(plain).into_iter().collect();
    let uncheckpointed = crate::checkpoint::uncheckpointed_segments();
    ids(checkpointed)
        .into_iter()
        .map(|(path, id)| {
            let recomputed = cp_events
                .iter()
                .filter(|event| matches!(event, Event::Recompute { id: r, .. } if *r == id))
                .count();
            let kept_plain = plain_ids
                .get(&path)
                .and_then(|&plain_id| kept(plain_events, plain_id))
                .filter(|_| measured);
            let ran_checkpointed = cp_events.iter().any(|event| {
                matches!(event, Event::Forward { id: f, checkpointed: true, .. } if *f == id)
            });
            let type_name = id.type_name();
            let captured = uncheckpointed
                .iter()
                .any(|name| name == &type_name || name.starts_with(&format!("{type_name}::")));
            let ran = cp_events
                .iter()
                .any(|event| matches!(event, Event::Forward { id: f, .. } if *f == id));
            let why_plain = if !ran {
                Some(format!(
                    "no `#[with_cp]` method of `{type_name}` ran: its `with_cp` flag is on, but \
                     the method that computes it (its forward) is not marked `#[with_cp]` (or \
                     it did not run in this step); mark it `#[with_cp]`"
                ))
            } else if !ran_checkpointed {
                Some(
                    "its input is not in the autodiff graph (MMCV's guard: a segment that gets \
                     the network's input is never checkpointed)"
                        .to_string(),
                )
            } else if recomputed == 0 && captured {
                Some(
                    "a tracked tensor entered it other than as its input or a parameter \
                     (captured by its closure, or held in a bare `Tensor` field): pass it as an \
                     input, or hold it in a `Param`"
                        .to_string(),
                )
            } else if recomputed == 0 {
                Some(
                    "it was not recomputed in backward (its output takes no part in the loss?)"
                        .to_string(),
                )
            } else {
                None
            };
            SegmentReport {
                checkpointed: why_plain.is_none(),
                why_plain,
                type_name,
                recomputed,
                kept_plain,
                kept_checkpointed: kept(cp_events, id).filter(|_| measured),
                path,
            }
        })
        .collect()
}

/// Initialises every lazy parameter, so that clones share their values. Burn initialises a
/// fresh model's weights on first use, and each clone of a fresh model draws its own: compare
/// two runs (with and without a strategy) from `materialise(model)` and its clones.
pub fn materialise<B: Backend, M: Module<B>>(model: M) -> M {
    struct Materialise;
    impl<B: Backend> ModuleMapper<B> for Materialise {}
    model.map(&mut Materialise)
}

/// Each float parameter's module path, by id.
fn param_names<B: Backend, M: Module<B>>(model: &M) -> HashMap<ParamId, String> {
    crate::train::params::param_paths(model)
        .into_iter()
        .map(|(id, path, _)| (id, path))
        .collect()
}

/// Every parameter's gradient as fp32 values, by id.
fn gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &B::Gradients,
) -> HashMap<ParamId, Vec<f32>> {
    struct Collect<'a, B: AutodiffBackend>(&'a B::Gradients, HashMap<ParamId, Vec<f32>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = param.val().grad(self.0) {
                if let Ok(values) = grad.cast(DType::F32).into_data().to_vec::<f32>() {
                    self.1.insert(param.id, values);
                }
            }
        }
    }
    let mut collect = Collect::<B>(grads, HashMap::new());
    model.visit(&mut collect);
    collect.1
}

/// The worst over parameters of `max |a - b| / max |b|` (against the largest gradient for one
/// that is zero or nearly so in exact arithmetic), and where it is. A parameter with a
/// gradient in one set and not the other counts as a difference of 1.
fn relative_difference(
    a: &HashMap<ParamId, Vec<f32>>,
    b: &HashMap<ParamId, Vec<f32>>,
) -> (f64, Option<ParamId>) {
    let abs_max = |v: &[f32]| v.iter().fold(0.0_f64, |m, x| m.max(x.abs() as f64));
    let largest = b.values().fold(0.0_f64, |m, v| m.max(abs_max(v)));
    let mut worst = (0.0_f64, None);
    for id in a.keys().chain(b.keys()) {
        let difference = match (a.get(id), b.get(id)) {
            (Some(got), Some(reference)) if got.len() == reference.len() => {
                let diff = got
                    .iter()
                    .zip(reference)
                    .fold(0.0_f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
                let scale = abs_max(reference);
                let scale = if scale < 1e-3 * largest {
                    largest
                } else {
                    scale
                };
                if diff == 0.0 {
                    0.0
                } else if scale > 0.0 {
                    diff / scale
                } else {
                    f64::INFINITY
                }
            }
            _ => 1.0,
        };
        if difference.is_nan() || difference > worst.0 || (worst.1.is_none() && difference > 0.0) {
            worst = (difference, Some(*id));
        }
    }
    worst
}
