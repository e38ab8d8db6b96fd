//! `with_cp = "auto"`: the hook that profiles the first iteration, plans for the budget,
//! applies the plan and checks the next steps' peaks.

use std::cell::RefCell;
use std::io::Write;
use std::rc::Rc;

use burn::tensor::backend::AutodiffBackend;

use super::advise;
use super::profile_hook::{set_flags, ProfileHook};
use super::{plan, Budget, ModelKeys, Plan, Profile};
use crate::checkpoint::CheckpointModule;
use crate::memory::{meter_for, Meter};
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// How many steps after the plan applies have their peak checked against the budget.
pub(crate) const CHECKED_STEPS: usize = 3;

/// `with_cp = "auto"`: profiles the run's first iteration (every segment checkpointed, the
/// same gradients as without), plans for the budget, applies the plan from the next iteration,
/// and checks the measured peak of the following `CHECKED_STEPS` iterations: one over the
/// budget has segments added by the excess, and is logged. A budget below what checkpointing
/// everything takes ends the run (before any snapshot of that step) with the advice of
/// [`advise::advise`].
pub struct AutoPlanHook {
    budget: Budget,
    setting: advise::Setting,
    keys: ModelKeys,
    profile: ProfileHook,
    planned: Option<(Profile, Plan, u64)>,
    checked: usize,
    meter: Option<Box<dyn Meter>>,
    current: Rc<RefCell<Vec<String>>>,
    allow_approximate: bool,
}

impl AutoPlanHook {
    /// A planner for `budget` on `device`; `setting` is the config's and `keys` the model's own
    /// settings in it (for the advice).
    pub fn new<D: 'static>(
        budget: Budget,
        setting: advise::Setting,
        keys: ModelKeys,
        device: &D,
    ) -> Result<Self> {
        let no_meter = || {
            Error::invalid(
                keys.with_cp,
                "\"auto\" measures memory, and it cannot be read here: memsave's counting \
                 allocator is not this program's global allocator (see memsave::memory), and \
                 the device is not CUDA",
            )
        };
        Ok(AutoPlanHook {
            budget,
            setting,
            keys,
            profile: ProfileHook::new(usize::MAX, meter_for(device).ok_or_else(no_meter)?),
            planned: None,
            checked: 0,
            meter: Some(meter_for(device).ok_or_else(no_meter)?),
            current: Rc::new(RefCell::new(Vec::new())),
            allow_approximate: false,
        })
    }

    /// Lets the advice name approximate strategies (8-bit optimizer state: `[memory]
    /// allow_approximate`).
    pub fn with_allow_approximate(mut self, allow: bool) -> Self {
        self.allow_approximate = allow;
        self
    }

    /// The profile, the plan and the budget in bytes, once planned.
    pub fn planned(&self) -> Option<&(Profile, Plan, u64)> {
        self.planned.as_ref()
    }

    /// Reads the peaks of the checked steps with `meter` instead of the device's.
    pub fn with_check_meter(mut self, meter: Box<dyn Meter>) -> Self {
        self.meter = Some(meter);
        self
    }

    /// The checkpointed segments' paths as they stand (shared, for reading after the run).
    pub fn plan_handle(&self) -> Rc<RefCell<Vec<String>>> {
        self.current.clone()
    }
}

/// A notice (a `tracing` event with target `memsave`) and a line in `train.log` in the work
/// directory.
pub(super) fn note<B: AutodiffBackend, M: TrainModel<B>>(state: &TrainState<B, M>, line: &str) {
    tracing::info!(target: "memsave", "{line}");
    if std::fs::create_dir_all(&state.work_dir).is_ok() {
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state.work_dir.join("train.log"))
        {
            let _ = writeln!(file, "memsave: {line}");
        }
    }
}

/// The advice for a budget nothing fits with checkpointing alone, in words.
pub(crate) fn advice_text(candidates: &[advise::Candidate], budget: u64) -> String {
    let human = crate::memory::human;
    let mut lines = vec![format!(
        "what would fit {} (predicted from the profiled step; `memsave plan CONFIG --budget SIZE` \
         also measures mixed precision and half the batch):",
        human(budget)
    )];
    let fitting: Vec<&advise::Candidate> = candidates.iter().filter(|c| c.fits).take(4).collect();
    if fitting.is_empty() {
        let least = candidates.iter().min_by_key(|c| c.peak);
        lines.push(format!(
            "  nothing memsave can switch on: the least is {} ({}); a larger budget or device \
             is needed",
            least.map_or("?".to_string(), |c| human(c.peak)),
            least.map_or("?".to_string(), |c| c.label.clone())
        ));
    }
    for candidate in fitting {
        let changes = candidate
            .changes_training
            .as_ref()
            .map(|c| format!("; {c}"))
            .unwrap_or_default();
        lines.push(format!(
            "  {}: peak {}, step {:.3} s{changes}\n    --set {}",
            candidate.label,
            human(candidate.peak),
            candidate.seconds,
            candidate.sets.join(" --set ")
        ));
    }
    lines.join("\n")
}

impl<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule> Hook<B, M> for AutoPlanHook {
    fn name(&self) -> &'static str {
        "planner"
    }

    fn out_of_memory_advice(&self, state: &TrainState<B, M>) -> Option<String> {
        let (profile, plan, _) = self.planned.as_ref()?;
        // What the device held when it could give no more: its pools' high-water mark on CUDA.
        let held = crate::memory::device_peak_bytes(&state.device)?;
        let measured = [advise::Measured {
            setting: self.setting,
            profile: profile.clone(),
        }];
        let candidates = advise::advise(
            &self.setting,
            &measured,
            held,
            &self.keys,
            self.allow_approximate,
            None,
        );
        Some(format!(
            "the plan ({} of {} segments checkpointed, predicted {}) did not fit; {}",
            plan.paths.len(),
            profile.segments.len(),
            crate::memory::human(plan.peak),
            advice_text(&candidates, held)
        ))
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.profile.iter = state.iter;
        set_flags(state, &|_| true);
        Ok(())
    }

    fn after_first_pass(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.profile.iter {
            self.profile.first_pass_done(state);
        }
        Ok(())
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if state.iter == self.profile.iter {
            self.profile.begin(state);
        } else if self.planned.is_some() && self.checked < CHECKED_STEPS {
            if let Some(meter) = &self.meter {
                meter.window_peak();
            }
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let human = crate::memory::human;
        if state.iter == self.profile.iter && self.profile.skipped(state) {
            note(
                state,
                &format!(
                    "plan: iteration {} was skipped on a gradient overflow, not a step to plan \
                     from; profiling iteration {} instead",
                    state.iter, self.profile.iter
                ),
            );
            return Ok(());
        }
        if state.iter == self.profile.iter {
            let Some(profile) = self.profile.end(state) else {
                return Ok(());
            };
            let unplanned = profile.unplanned_peak();
            let budget = self.budget.bytes(unplanned);
            match plan(&profile, budget) {
                Ok(plan) => {
                    let chosen = plan.paths.clone();
                    set_flags(state, &|path| chosen.iter().any(|p| p == path));
                    *self.current.borrow_mut() = chosen.clone();
                    note(
                        state,
                        &format!(
                            "plan: checkpoint {} of {} segments ({}) for a budget of {} ({}); \
                             predicted peak {} (unplanned {}, all checkpointed {}), step {:.3} s \
                             (all checkpointed {:.3} s){}",
                            plan.paths.len(),
                            profile.segments.len(),
                            if plan.paths.is_empty() {
                                "none".to_string()
                            } else {
                                plan.paths.join(", ")
                            },
                            human(budget),
                            self.budget,
                            human(plan.peak),
                            human(unplanned),
                            human(profile.floor()),
                            plan.seconds,
                            profile.step_seconds,
                            if plan.exact {
                                ""
                            } else {
                                "; not proven optimal (greedy)"
                            }
                        ),
                    );
                    self.planned = Some((profile, plan, budget));
                }
                Err(below) => {
                    let measured = [advise::Measured {
                        setting: self.setting,
                        profile: profile.clone(),
                    }];
                    let candidates = advise::advise(
                        &self.setting,
                        &measured,
                        budget,
                        &self.keys,
                        self.allow_approximate,
                        None,
                    );
                    return Err(Error::OutOfMemory {
                        what: format!(
                            "one step with every one of the {} segments checkpointed, the \
                             least any checkpoint set takes,",
                            profile.segments.len()
                        ),
                        needed: below.floor,
                        place: format!("the memory budget `{}`", self.budget),
                        available: Some(budget),
                        advice: advice_text(&candidates, budget),
                    });
                }
            }
            return Ok(());
        }
        let Some((profile, current, budget)) = self.planned.clone() else {
            return Ok(());
        };
        if self.checked >= CHECKED_STEPS {
            return Ok(());
        }
        self.checked += 1;
        let Some(measured) = self.meter.as_ref().map(|p| p.window_peak()) else {
            return Ok(());
        };
        let line = format!(
            "plan: step {}: budget={budget} predicted={} measured={measured}",
            state.iter + 1,
            current.peak
        );
        if measured <= budget {
            note(state, &line);
            return Ok(());
        }
        // Over: demand the excess of the prediction, and checkpoint what that needs.
        let excess = measured - budget;
        let tighter = budget.saturating_sub(excess);
        let next = plan(&profile, tighter).unwrap_or_else(|below| {
            let all = vec![true; profile.segments.len()];
            let _ = below;
            Plan {
                paths: profile.segments.iter().map(|s| s.path.clone()).collect(),
                peak: profile.predict_peak(&all),
                seconds: profile.predict_seconds(&all),
                checkpointed: all,
                exact: false,
            }
        });
        let added: Vec<String> = next
            .paths
            .iter()
            .filter(|p| !current.paths.contains(p))
            .cloned()
            .collect();
        let chosen = next.paths.clone();
        set_flags(state, &|path| chosen.iter().any(|p| p == path));
        *self.current.borrow_mut() = chosen.clone();
        note(
            state,
            &format!(
                "{line}: over the budget by {}; checkpointing {} more segment(s) ({})",
                human(excess),
                added.len(),
                if added.is_empty() {
                    "none left: the budget cannot be held by checkpointing".to_string()
                } else {
                    added.join(", ")
                }
            ),
        );
        self.planned = Some((profile, next, budget));
        Ok(())
    }
}
