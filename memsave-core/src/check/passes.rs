//! The passes the check runs: each forward and backward, reseeded and recorded, its
//! gradients, and what the recordings say of each segment.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;

use super::report::{CheckReport, PassReport, SegmentReport};
use super::ModelCheck;
use crate::checkpoint::profile::{self, Event};
use crate::checkpoint::{join_helpers, set_with_cp, CheckpointModule, SegmentId};
use crate::memory::{self, Meter};
use crate::{Error, Result};

/// The passes run so far, with their gradients.
pub(super) struct Passes<'a> {
    check: &'a ModelCheck,
    meter: Option<Box<dyn Meter>>,
    meter_name: String,
    pub(super) names: HashMap<ParamId, String>,
    pub(super) passes: Vec<(PassReport, HashMap<ParamId, Vec<f32>>)>,
    segments: Vec<SegmentReport>,
}

impl<'a> Passes<'a> {
    pub(super) fn new<B: AutodiffBackend, M: AutodiffModule<B>>(
        check: &'a ModelCheck,
        model: &M,
    ) -> Self {
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
    pub(super) fn pair<B, M, L>(
        &mut self,
        precision: &str,
        model: &M,
        loss: &L,
        scale: f64,
    ) -> Result<()>
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
        join_helpers()?;
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

    /// The report. A segment switched on whose type ran no `#[with_cp]` method is the run's
    /// error by default, as in the runner ([`crate::check::segments_ran`]); where the run says
    /// to warn, the report names it.
    pub(super) fn report(self) -> Result<CheckReport> {
        let mut missing: Vec<String> = Vec::new();
        for segment in &self.segments {
            if segment.recomputed == 0
                && segment
                    .why_plain
                    .as_deref()
                    .is_some_and(|why| why.starts_with(NO_METHOD))
                && !missing.contains(&segment.type_name)
            {
                missing.push(segment.type_name.clone());
            }
        }
        if !missing.is_empty()
            && crate::checkpoint::unused_with_cp() == crate::checkpoint::UnusedWithCp::Error
        {
            return Err(Error::invalid(
                "with_cp",
                crate::checkpoint::no_segment_message(&missing),
            ));
        }
        Ok(CheckReport {
            passes: self.passes.into_iter().map(|(report, _)| report).collect(),
            segments: self.segments,
            meter: self.meter_name,
        })
    }
}

/// How the report says a segment's type ran no `#[with_cp]` method.
const NO_METHOD: &str = "no `#[with_cp]` method of ";

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
                    "{NO_METHOD}`{type_name}` ran: its `with_cp` flag is on, but the method \
                     that computes it (its forward) is not marked `#[with_cp]` (or it did not \
                     run in this step); mark it `#[with_cp]`"
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
pub(super) fn relative_difference(
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
