//! The combinations considered from a setting, each predicted from the nearest measured
//! profile, planned, and ranked.

use super::candidate::{candidate, Candidate};
use super::scale::{scale_timed, BatchTime};
use super::setting::{Measured, Setting};
use crate::planner::ModelKeys;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::advise::{scale, INT8_STATE_SHARE};
    use crate::planner::solve::tests::chain;
    use crate::planner::Profile;

    const KEYS: ModelKeys = ModelKeys {
        with_cp: "model.backbone.with_cp",
        batch: "data.samples_per_gpu",
        also_with_cp: &[],
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
