//! The cheapest combination of strategies that fits a budget: a checkpoint set, mixed
//! precision, accumulation (batch b as b/k x k), the optimizer's step in backward, 8-bit
//! optimizer state (approximate: only when allowed), SGD instead of Adam, and, last, a smaller
//! batch, each predicted from measured profiles.
//!
//! A combination is predicted from the measured profile nearest to it (same precision, the
//! nearest batch per micro-step): the bytes above the resident ones in every window but the
//! optimizer step's, and every segment's kept bytes, scale with the batch; under accumulation
//! the gradient sums stay live through every micro-step (fp32, the size of the trainable
//! weights, beside the half gradients under mixed precision) and the step takes k micro-steps;
//! SGD (with momentum) keeps one copy of the trainable weights fewer than Adam. The step in
//! backward is predicted from a profile measured with it (its windows hold next to no
//! gradient); under clipping or mixed precision it takes two passes, the first's time measured
//! or, from a one-pass profile, its forward and backward again. 8-bit state keeps a quarter of
//! the state's bytes (plus a scale per block), and costs the step the time measured for it.
//! A micro-batch's time is fitted as a fixed part plus a part per sample on the config's batch
//! and half of it (both measured), so that a smaller micro-batch is not predicted faster than
//! it runs. Then the checkpoint set is planned on that prediction.

use serde::{Deserialize, Serialize};

use super::budget::ModelKeys;
use super::profile::Profile;
use super::solve::{plan, Plan};

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
    /// The optimizer steps each parameter in backward (`step_in_backward`).
    #[serde(default)]
    pub step_in_backward: bool,
    /// The optimizer's state is kept in 8 bits (`state_dtype = "int8"`).
    #[serde(default)]
    pub int8_state: bool,
    /// The config clips the gradients by their global norm (a step in backward then takes two
    /// passes).
    #[serde(default)]
    pub clips: bool,
}

impl Setting {
    /// Samples per optimizer step.
    pub fn batch(&self) -> usize {
        self.micro_batch * self.cumulative
    }

    /// Forwards and backwards per micro-batch that steps: 2 for a step in backward under
    /// clipping or mixed precision, else 1.
    pub fn passes(&self) -> usize {
        if self.step_in_backward && (self.clips || self.fp16) {
            2
        } else {
            1
        }
    }

    /// Copies of the trainable weights the optimizer keeps: Adam's two moments, SGD's momentum.
    fn state_copies(&self) -> u64 {
        if self.adam {
            2
        } else {
            1
        }
    }
}

/// Bytes one byte of fp32 optimizer state takes in 8 bits (a byte a value, a scale per block).
pub const INT8_STATE_SHARE: f64 = (1.0 + 4.0 / crate::train::quant::BLOCK as f64) / 4.0;

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
    /// Whether it changes the arithmetic beyond rounding (8-bit optimizer state).
    #[serde(default)]
    pub approximate: bool,
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
    if setting.step_in_backward != current.step_in_backward {
        sets.push(format!(
            "optimizer_config.step_in_backward={}",
            setting.step_in_backward
        ));
    }
    if setting.int8_state != current.int8_state {
        let dtype = if setting.int8_state { "int8" } else { "fp32" };
        sets.push(format!("optimizer.state_dtype=\"{dtype}\""));
    }
    let quoted: Vec<String> = paths.iter().map(|p| format!("\"{p}\"")).collect();
    sets.push(format!("{}=[{}]", keys.with_cp, quoted.join(", ")));
    sets
}

/// How a micro-batch's time grows with its samples: `fixed + per_sample * samples`, fitted on
/// two profiles of one setting measured at two batches (a step has costs that do not shrink
/// with its batch: on a CPU, each op's threads and passes; on a GPU, launches). Without two
/// such profiles, time is taken as proportional to the batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchTime {
    /// Seconds of a micro-batch that do not depend on its samples.
    pub fixed: f64,
    /// Seconds per sample.
    pub per_sample: f64,
}

impl BatchTime {
    /// Time proportional to the batch.
    pub const PROPORTIONAL: BatchTime = BatchTime {
        fixed: 0.0,
        per_sample: 1.0,
    };

    /// The line through two measured (samples, seconds) points; proportional where they do
    /// not give a line with a non-negative fixed part and a positive slope.
    pub fn fit((m1, t1): (usize, f64), (m2, t2): (usize, f64)) -> BatchTime {
        if m1 == m2 || !(t1 > 0.0 && t2 > 0.0) {
            return BatchTime::PROPORTIONAL;
        }
        let per_sample = (t1 - t2) / (m1 as f64 - m2 as f64);
        let fixed = t1 - per_sample * m1 as f64;
        if per_sample <= 0.0 || fixed < 0.0 {
            return BatchTime::PROPORTIONAL;
        }
        BatchTime { fixed, per_sample }
    }

    /// A micro-batch of `to` samples' time over one of `from` samples'.
    pub fn ratio(&self, from: usize, to: usize) -> f64 {
        let time = |samples: usize| self.fixed + self.per_sample * samples as f64;
        time(to) / time(from.max(1))
    }
}

/// `profile` as predicted for `to`, from the `from` it was measured in; `int8_seconds`: what
/// 8-bit state adds to a step, as measured. Time scales with the batch in proportion.
pub fn scale(profile: &Profile, from: &Setting, to: &Setting, int8_seconds: f64) -> Profile {
    scale_timed(profile, from, to, int8_seconds, BatchTime::PROPORTIONAL)
}

/// [`scale`], a micro-batch's time following `batch_time`.
pub fn scale_timed(
    profile: &Profile,
    from: &Setting,
    to: &Setting,
    int8_seconds: f64,
    batch_time: BatchTime,
) -> Profile {
    let factor = to.micro_batch as f64 / from.micro_batch.max(1) as f64;
    // Seconds: each micro-batch's time, times the micro-batches.
    let time_factor = batch_time.ratio(from.micro_batch, to.micro_batch);
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
    let micro_steps = time_factor * to.cumulative as f64 / from.cumulative as f64;
    for segment in &mut out.segments {
        segment.kept_bytes = (segment.kept_bytes as f64 * factor) as u64;
        segment.recompute_seconds *= micro_steps;
        segment.forward_seconds *= micro_steps;
    }
    out.step_seconds = profile.step_seconds * micro_steps;
    out.forward_seconds *= micro_steps;
    out.backward_seconds *= micro_steps;
    out.first_pass_seconds *= time_factor;
    out.growth = profile.growth.saturating_sub(optimizer_copy);
    // The passes of the group's last micro-batch: a first pass to find the norm, or none.
    match (profile.passes.max(1), to.passes()) {
        (1, 2) => {
            out.passes = 2;
            out.first_pass_seconds =
                (profile.forward_seconds + profile.backward_seconds) * time_factor;
        }
        (2, 1) => {
            out.passes = 1;
            out.first_pass_seconds = 0.0;
        }
        _ => {}
    }
    // 8-bit state: a quarter of the state's bytes, resident in every window.
    if to.int8_state != from.int8_state {
        let state = (profile.trainable * to.state_copies()) as f64;
        let saved = (state * (1.0 - INT8_STATE_SHARE)) as u64;
        let seconds = if to.int8_state {
            int8_seconds
        } else {
            -int8_seconds
        };
        out.step_seconds = (out.step_seconds + seconds).max(0.0);
        for window in &mut out.windows {
            window.peak = if to.int8_state {
                window.peak.saturating_sub(saved)
            } else {
                window.peak + saved
            };
        }
        out.resident = if to.int8_state {
            out.resident.saturating_sub(saved)
        } else {
            out.resident + saved
        };
    }
    out
}

/// Every combination worth considering from `current`, best first: those that fit, in order of
/// how little they change (the training kept, then SGD, then a smaller batch) and then of
/// predicted time; then those that do not fit, by predicted peak. The step in backward is
/// considered where a profile was measured with it, 8-bit state only where
/// `allow_approximate` (and a profile measured with it gives its time).
/// `keys` are the model's own settings in the config.
pub fn advise(
    current: &Setting,
    measured: &[Measured],
    budget: u64,
    keys: &ModelKeys,
    allow_approximate: bool,
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
    let mut in_backward = vec![current.step_in_backward];
    if !current.step_in_backward && measured.iter().any(|m| m.setting.step_in_backward) {
        in_backward.push(true);
    }
    // What 8-bit state adds to a step: a profile measured with it beside one without.
    let int8_seconds = measured
        .iter()
        .filter(|m| m.setting.int8_state != current.int8_state)
        .find_map(|m| {
            let plain = measured.iter().find(|p| {
                p.setting.int8_state == current.int8_state
                    && p.setting.fp16 == m.setting.fp16
                    && p.setting.micro_batch == m.setting.micro_batch
                    && p.setting.step_in_backward == m.setting.step_in_backward
            })?;
            let delta = m.profile.step_seconds - plain.profile.step_seconds;
            Some(if m.setting.int8_state { delta } else { -delta }.max(0.0))
        });
    let mut int8 = vec![current.int8_state];
    if !current.int8_state && allow_approximate && int8_seconds.is_some() {
        int8.push(true);
    }
    for &adam in &optimizers {
        for &fp16 in &precisions {
            for &step_in_backward in &in_backward {
                for &int8_state in &int8 {
                    let with = |micro_batch: usize, cumulative: usize| Setting {
                        fp16,
                        micro_batch,
                        cumulative,
                        adam,
                        step_in_backward,
                        int8_state,
                        clips: current.clips,
                    };
                    // Accumulation: the same samples per optimizer step.
                    for &k in &divisors {
                        settings.push(with(batch / k, k));
                    }
                    // A smaller batch: fewer samples per step.
                    for &smaller in divisors.iter().rev().skip(1) {
                        settings.push(with(smaller, 1));
                    }
                }
            }
        }
    }
    // A micro-batch's time against its samples, from two profiles of one setting at two
    // batches (the config's and half its batch).
    let batch_time = {
        let mut points = measured.iter().filter(|m| {
            Setting {
                micro_batch: current.micro_batch,
                ..m.setting
            } == *current
        });
        match (points.next(), points.next()) {
            (Some(a), Some(b)) => BatchTime::fit(
                (
                    a.setting.micro_batch,
                    a.profile.step_seconds / a.setting.cumulative as f64,
                ),
                (
                    b.setting.micro_batch,
                    b.profile.step_seconds / b.setting.cumulative as f64,
                ),
            ),
            _ => BatchTime::PROPORTIONAL,
        }
    };
    let mut candidates: Vec<Candidate> = settings
        .iter()
        .filter_map(|setting| {
            let source = measured
                .iter()
                .filter(|m| {
                    m.setting.fp16 == setting.fp16
                        && m.setting.step_in_backward == setting.step_in_backward
                })
                .min_by_key(|m| {
                    (
                        m.setting.int8_state != setting.int8_state,
                        m.setting.adam != setting.adam && !m.setting.adam,
                        {
                            let d = m.setting.micro_batch as i64 - setting.micro_batch as i64;
                            d.abs()
                        },
                    )
                })?;
            let profile = scale_timed(
                &source.profile,
                &source.setting,
                setting,
                int8_seconds.unwrap_or(0.0),
                batch_time,
            );
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
    if setting.step_in_backward && !current.step_in_backward {
        words.push(if setting.passes() > 1 {
            "step in backward (two passes)".to_string()
        } else {
            "step in backward".to_string()
        });
    }
    if setting.int8_state && !current.int8_state {
        words.push("8-bit optimizer state (approximate)".to_string());
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
    if setting.int8_state && !current.int8_state {
        changes.push(
            "the optimizer's state is kept in 8 bits (approximate: measure its training cost)"
                .to_string(),
        );
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
        approximate: setting.int8_state && !current.int8_state,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::solve::tests::chain;

    const KEYS: ModelKeys = ModelKeys {
        with_cp: "model.backbone.with_cp",
        batch: "data.samples_per_gpu",
    };

    fn setting() -> Setting {
        Setting {
            fp16: false,
            micro_batch: 2,
            cumulative: 1,
            adam: true,
            step_in_backward: false,
            int8_state: false,
            clips: true,
        }
    }

    /// Four segments of 100 bytes kept each; the resident bytes 1000 (weights, Adam's two
    /// moments: 200 trainable bytes); the step's gradients 200 at its end.
    fn profile(gradients: u64, step: f64) -> Profile {
        let mut profile = chain(
            &[100, 100, 100, 100],
            &[1.0, 1.0, 1.0, 1.0],
            &[1100, 1100, 1100, 1100],
            1100,
            1100,
            1000 + gradients,
        );
        profile.resident = 1000;
        profile.trainable = 200;
        profile.step_seconds = step;
        profile.forward_seconds = 3.0;
        profile.backward_seconds = 5.0;
        for window in &mut profile.windows {
            if window.label == "step" {
                window.gradients = gradients;
            }
        }
        profile
    }

    fn measured() -> Vec<Measured> {
        vec![
            Measured {
                setting: setting(),
                profile: profile(200, 14.0),
            },
            Measured {
                setting: Setting {
                    step_in_backward: true,
                    ..setting()
                },
                profile: profile(0, 14.0),
            },
            Measured {
                setting: Setting {
                    int8_state: true,
                    ..setting()
                },
                profile: {
                    // Measured: the moments in 8 bits (298 of their 400 bytes fewer).
                    let mut profile = profile(200, 14.5);
                    profile.resident -= 298;
                    for window in &mut profile.windows {
                        window.peak -= 298;
                    }
                    profile
                },
            },
        ]
    }

    #[test]
    fn the_step_in_backward_is_offered_with_its_second_pass_priced() {
        // Budget 1150: the weights and state (1000) and 150 more.
        let candidates = advise(&setting(), &measured(), 1150, &KEYS, false);
        let in_backward = candidates
            .iter()
            .find(|c| {
                c.setting
                    == Setting {
                        step_in_backward: true,
                        ..setting()
                    }
            })
            .expect("offered");
        assert!(in_backward.fits, "{in_backward:?}");
        assert_eq!(
            candidates[0].label, in_backward.label,
            "the first that keeps the training"
        );
        assert!(in_backward.label.contains("step in backward (two passes)"));
        assert!(in_backward
            .sets
            .contains(&"optimizer_config.step_in_backward=true".to_string()));
        // Every segment checkpointed: the one-pass profile's time plus a forward and a
        // backward (clipping: two passes).
        assert_eq!(in_backward.checkpoint.len(), 4);
        assert!(
            (in_backward.seconds - (14.0 + 3.0 + 5.0)).abs() < 1e-9,
            "{}",
            in_backward.seconds
        );
        // Without it, the gradients (200 bytes) do not fit.
        assert!(candidates
            .iter()
            .filter(|c| c.setting == setting())
            .all(|c| !c.fits));
        assert!(
            candidates.iter().all(|c| !c.setting.int8_state),
            "not allowed"
        );
        assert!(candidates.iter().all(|c| !c.approximate));
    }

    #[test]
    fn eight_bit_state_is_offered_only_when_allowed_and_marked_approximate() {
        let candidates = advise(&setting(), &measured(), 900, &KEYS, true);
        let int8 = candidates
            .iter()
            .find(|c| c.setting.int8_state && !c.setting.step_in_backward && !c.setting.fp16)
            .expect("offered when allowed");
        assert!(int8.approximate);
        assert!(int8
            .sets
            .contains(&"optimizer.state_dtype=\"int8\"".to_string()));
        assert!(int8.changes_training.as_ref().unwrap().contains("8 bits"));
        // Where the 8-bit state was not measured with the rest (the step in backward): two
        // moments of 200 bytes are 400 * (1 - 0.254) fewer resident bytes, and the step takes
        // the measured half second more.
        let from = Setting {
            step_in_backward: true,
            ..setting()
        };
        let to = Setting {
            int8_state: true,
            ..from
        };
        let source = profile(0, 14.0);
        let scaled = scale(&source, &from, &to, 0.5);
        let saved = (400.0 * (1.0 - INT8_STATE_SHARE)) as u64;
        assert_eq!(saved, 298);
        assert_eq!(source.resident - scaled.resident, saved);
        for (a, b) in source.windows.iter().zip(&scaled.windows) {
            assert_eq!(a.peak - b.peak, saved, "{}", a.label);
        }
        assert!((scaled.step_seconds - source.step_seconds - 0.5).abs() < 1e-9);
        assert!(candidates.iter().any(|c| c.setting == to && c.approximate));
        let strict = advise(&setting(), &measured(), 900, &KEYS, false);
        assert!(strict.iter().all(|c| !c.setting.int8_state));
    }

    #[test]
    fn a_micro_batchs_time_has_a_fixed_part_fitted_on_two_batches() {
        let fit = BatchTime::fit((4, 4.0), (2, 2.5));
        assert!((fit.fixed - 1.0).abs() < 1e-12 && (fit.per_sample - 0.75).abs() < 1e-12);
        assert!((fit.ratio(4, 1) - 1.75 / 4.0).abs() < 1e-12);
        // No line with a non-negative fixed part: proportional.
        assert_eq!(BatchTime::fit((4, 4.0), (2, 1.5)), BatchTime::PROPORTIONAL);
        assert_eq!(BatchTime::fit((4, 4.0), (4, 3.0)), BatchTime::PROPORTIONAL);
        // In the advice: the config's batch (2, 14 s) and half of it (1, 10 s) give the
        // accumulation 1 x 2 candidate two micro-batches of 10 s, not of 7.
        let mut measured = measured();
        measured.push(Measured {
            setting: Setting {
                micro_batch: 1,
                ..setting()
            },
            profile: profile(200, 10.0),
        });
        let candidates = advise(&setting(), &measured, 1 << 40, &KEYS, false);
        let accumulated = Setting {
            micro_batch: 1,
            cumulative: 2,
            ..setting()
        };
        let candidate = candidates
            .iter()
            .find(|c| c.setting == accumulated)
            .expect("accumulation 1 x 2");
        // From the batch-1 profile (the nearest): 10 s per micro-batch, two of them, less the
        // four segments' recomputation (1 s each per micro-batch; none is checkpointed).
        assert!(
            (candidate.seconds - 2.0 * (10.0 - 4.0)).abs() < 1e-9,
            "{}",
            candidate.seconds
        );
        // The step in backward at batch 1 x 2, from its batch-2 profile: 10/14 of each pass
        // (proportional: 7/14), with a first pass of its forward and backward (8 s at batch 2),
        // and no recomputation in either pass.
        let in_backward = candidates
            .iter()
            .find(|c| {
                c.setting
                    == Setting {
                        step_in_backward: true,
                        ..accumulated
                    }
            })
            .expect("accumulation 1 x 2 with the step in backward");
        let ratio = 10.0 / 14.0;
        let expected = 14.0 * ratio * 2.0 + (3.0 + 5.0) * ratio - 2.0 * (4.0 * ratio * 2.0);
        assert!(
            (in_backward.seconds - expected).abs() < 1e-9,
            "{} vs {expected}",
            in_backward.seconds
        );
    }
}
