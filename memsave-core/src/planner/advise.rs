//! The cheapest combination of strategies that fits a budget: a checkpoint set, mixed
//! precision, accumulation (batch b as b/k x k), SGD instead of Adam, and, last, a smaller
//! batch, each predicted from measured profiles.
//!
//! A combination is predicted from the measured profile nearest to it (same precision, the
//! nearest batch per micro-step): the bytes above the resident ones in every window but the
//! optimizer step's, and every segment's kept bytes, scale with the batch; under accumulation
//! the gradient sums stay live through every micro-step (fp32, the size of the trainable
//! weights, beside the half gradients under mixed precision) and the step takes k micro-steps;
//! SGD (with momentum) keeps one copy of the trainable weights fewer than Adam. Then the
//! checkpoint set is planned on that prediction.

use serde::{Deserialize, Serialize};

use super::profile::Profile;
use super::solve::{plan, Plan};
use crate::config::ModelKeys;

/// What a step is made of, for the advice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setting {
    /// Mixed precision.
    pub fp16: bool,
    /// Samples per micro-step.
    pub micro_batch: usize,
    /// Micro-steps per optimizer step.
    pub cumulative: usize,
    /// Adam or AdamW: two moments per weight (else SGD, with at most one).
    pub adam: bool,
}

impl Setting {
    /// Samples per optimizer step.
    pub fn batch(&self) -> usize {
        self.micro_batch * self.cumulative
    }
}

/// A measured profile and the setting it was measured in.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The setting.
    pub setting: Setting,
    /// Its profile.
    pub profile: Profile,
}

/// One combination considered.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Candidate {
    /// In words (`mixed precision + checkpoint 5 of 16 segments`).
    pub label: String,
    /// The setting.
    pub setting: Setting,
    /// The checkpointed segments' paths (empty: none needed).
    pub checkpoint: Vec<String>,
    /// Predicted peak, bytes.
    pub peak: u64,
    /// Predicted optimizer-step time, seconds.
    pub seconds: f64,
    /// Whether it fits the budget.
    pub fits: bool,
    /// How it changes the training, if it does (`the batch is 2, not 4`).
    pub changes_training: Option<String>,
    /// Whether the checkpoint search was exact.
    pub exact: bool,
    /// The config overrides that apply it (`--set` arguments).
    pub sets: Vec<String>,
}

/// The config overrides for `setting` (from `current`) and the checkpoint `paths`, the model's
/// own settings at its `keys`.
pub fn overrides(
    current: &Setting,
    setting: &Setting,
    paths: &[String],
    keys: &ModelKeys,
) -> Vec<String> {
    let mut sets = Vec::new();
    if setting.fp16 && !current.fp16 {
        sets.push("fp16.loss_scale=\"dynamic\"".to_string());
    }
    if setting.cumulative != current.cumulative {
        if setting.cumulative > 1 {
            sets.push("optimizer_config.type=\"GradientCumulativeOptimizerHook\"".to_string());
            sets.push(format!(
                "optimizer_config.cumulative_iters={}",
                setting.cumulative
            ));
        } else {
            sets.push("optimizer_config.type=\"OptimizerHook\"".to_string());
        }
    }
    if setting.micro_batch != current.micro_batch {
        sets.push(format!("{}={}", keys.batch, setting.micro_batch));
    }
    if current.adam && !setting.adam {
        sets.push("optimizer.type=\"SGD\"".to_string());
        sets.push("optimizer.momentum=0.9".to_string());
    }
    let quoted: Vec<String> = paths.iter().map(|p| format!("\"{p}\"")).collect();
    sets.push(format!("{}=[{}]", keys.with_cp, quoted.join(", ")));
    sets
}

/// `profile` as predicted for `to`, from the `from` it was measured in.
pub fn scale(profile: &Profile, from: &Setting, to: &Setting) -> Profile {
    let factor = to.micro_batch as f64 / from.micro_batch.max(1) as f64;
    let mut out = profile.clone();
    let optimizer_copy = if from.adam && !to.adam {
        profile.trainable
    } else {
        0
    };
    let accumulates = to.cumulative > 1 && from.cumulative == 1;
    let sums = if accumulates { profile.trainable } else { 0 };
    out.resident = profile.resident.saturating_sub(optimizer_copy);
    for window in &mut out.windows {
        let above = window
            .peak
            .saturating_sub(profile.resident + window.gradients);
        let gradients = if accumulates {
            if to.fp16 {
                sums + window.gradients
            } else {
                sums.max(window.gradients)
            }
        } else {
            window.gradients
        };
        let above = if window.batch_scaled {
            (above as f64 * factor) as u64
        } else {
            above
        };
        window.peak = out.resident + gradients + above;
        window.gradients = gradients;
        for (_, bytes) in &mut window.alive {
            *bytes = (*bytes as f64 * factor) as u64;
        }
    }
    for segment in &mut out.segments {
        segment.kept_bytes = (segment.kept_bytes as f64 * factor) as u64;
        segment.recompute_seconds *= factor * to.cumulative as f64 / from.cumulative as f64;
        segment.forward_seconds *= factor * to.cumulative as f64 / from.cumulative as f64;
    }
    out.step_seconds =
        profile.step_seconds * factor * to.cumulative as f64 / from.cumulative as f64;
    out.growth = profile.growth.saturating_sub(optimizer_copy);
    out
}

/// Every combination worth considering from `current`, best first: those that fit, in order of
/// how little they change (the training kept, then SGD, then a smaller batch) and then of
/// predicted time; then those that do not fit, by predicted peak.
/// `keys` are the model's own settings in the config.
pub fn advise(
    current: &Setting,
    measured: &[Measured],
    budget: u64,
    keys: &ModelKeys,
) -> Vec<Candidate> {
    let batch = current.batch();
    let divisors: Vec<usize> = (1..=batch).filter(|k| batch % k == 0).collect();
    let mut settings: Vec<Setting> = Vec::new();
    let precisions: Vec<bool> = if current.fp16 {
        vec![true]
    } else {
        vec![false, true]
    };
    let optimizers: Vec<bool> = if current.adam {
        vec![true, false]
    } else {
        vec![false]
    };
    for &adam in &optimizers {
        for &fp16 in &precisions {
            // Accumulation: the same samples per optimizer step.
            for &k in &divisors {
                settings.push(Setting {
                    fp16,
                    micro_batch: batch / k,
                    cumulative: k,
                    adam,
                });
            }
            // A smaller batch: fewer samples per step.
            for &smaller in divisors.iter().rev().skip(1) {
                settings.push(Setting {
                    fp16,
                    micro_batch: smaller,
                    cumulative: 1,
                    adam,
                });
            }
        }
    }
    let mut candidates: Vec<Candidate> = settings
        .iter()
        .filter_map(|setting| {
            let source = measured
                .iter()
                .filter(|m| m.setting.fp16 == setting.fp16)
                .min_by_key(|m| {
                    (m.setting.adam != setting.adam && !m.setting.adam, {
                        let d = m.setting.micro_batch as i64 - setting.micro_batch as i64;
                        d.abs()
                    })
                })?;
            let profile = scale(&source.profile, &source.setting, setting);
            Some(candidate(current, setting, &profile, budget, keys))
        })
        .collect();
    candidates.sort_by(|a, b| {
        let rank = |c: &Candidate| {
            (
                !c.fits,
                c.fits && c.setting.adam != current.adam,
                c.fits && c.setting.batch() != current.batch(),
            )
        };
        rank(a).cmp(&rank(b)).then(if a.fits {
            a.seconds.total_cmp(&b.seconds)
        } else {
            a.peak.cmp(&b.peak)
        })
    });
    candidates
}

fn candidate(
    current: &Setting,
    setting: &Setting,
    profile: &Profile,
    budget: u64,
    keys: &ModelKeys,
) -> Candidate {
    let (plan, fits) = match plan(profile, budget) {
        Ok(plan) => (plan, true),
        Err(_) => {
            let all = vec![true; profile.segments.len()];
            (
                Plan {
                    paths: profile.segments.iter().map(|s| s.path.clone()).collect(),
                    peak: profile.predict_peak(&all),
                    seconds: profile.predict_seconds(&all),
                    checkpointed: all,
                    exact: true,
                },
                false,
            )
        }
    };
    let mut words = Vec::new();
    if setting.fp16 && !current.fp16 {
        words.push("mixed precision".to_string());
    }
    if setting.cumulative > 1 {
        words.push(format!(
            "accumulation {} x {}",
            setting.micro_batch, setting.cumulative
        ));
    }
    if current.adam && !setting.adam {
        words.push("SGD instead of Adam(W)".to_string());
    }
    if setting.batch() != current.batch() {
        words.push(format!("batch {}", setting.batch()));
    }
    let checked = plan.paths.len();
    if checked > 0 {
        words.push(format!(
            "checkpoint {checked} of {} segments",
            profile.segments.len()
        ));
    }
    if words.is_empty() {
        words.push("as it stands".to_string());
    }
    let mut changes = Vec::new();
    if setting.batch() != current.batch() {
        changes.push(format!(
            "the batch is {}, not {} (a different training: scale the learning rate)",
            setting.batch(),
            current.batch()
        ));
    }
    if current.adam && !setting.adam {
        changes.push("SGD with momentum 0.9 replaces Adam(W) (a different optimizer)".to_string());
    }
    Candidate {
        label: words.join(" + "),
        setting: *setting,
        sets: overrides(current, setting, &plan.paths, keys),
        checkpoint: plan.paths,
        peak: plan.peak,
        seconds: plan.seconds,
        fits,
        changes_training: (!changes.is_empty()).then(|| changes.join("; ")),
        exact: plan.exact,
    }
}
