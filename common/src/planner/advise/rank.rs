//! The combinations considered from a setting, each predicted from the nearest measured
//! profile, planned, and ranked.

use super::candidate::{candidate, Candidate, Offload};
use super::scale::{scale_timed, BatchTime};
use super::setting::{Measured, Setting};
use super::staging::{OffloadCost, Staging};
use crate::planner::ModelKeys;

/// Every combination worth considering from `current`, best first: those that fit, in order of
/// how little they change (the training kept, then SGD, then a smaller batch) and then of
/// predicted time; then those that do not fit, by predicted peak. The step in backward is
/// considered where a profile was measured with it, 8-bit state only where
/// `allow_approximate` (and a profile measured with it gives its time), activation and optimizer
/// offload only with `staging` (a device that can stage) and where a profile was measured with
/// them (in the config's precision and place of the step).
/// `keys` are the model's own settings in the config.
pub fn advise(
    current: &Setting,
    measured: &[Measured],
    budget: u64,
    keys: &ModelKeys,
    allow_approximate: bool,
    staging: Option<&Staging>,
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
    // Offload (activations, optimizer): the config's, and where the device can stage, each
    // combination a profile was measured with.
    let offloaded = |m: &Measured| (m.setting.offload_activations, m.setting.offload_optimizer);
    let mut offloads = vec![(current.offload_activations, current.offload_optimizer)];
    if staging.is_some() {
        for (activations, optimizer) in [(true, false), (false, true), (true, true)] {
            let flags = (
                activations || current.offload_activations,
                optimizer || current.offload_optimizer,
            );
            if !offloads.contains(&flags) && measured.iter().any(|m| offloaded(m) == flags) {
                offloads.push(flags);
            }
        }
    }
    for &adam in &optimizers {
        for &fp16 in &precisions {
            for &step_in_backward in &in_backward {
                for &int8_state in &int8 {
                    for &(offload_activations, offload_optimizer) in &offloads {
                        // On the host the step taps as in backward whichever is asked: one
                        // place of the step is enough.
                        if offload_optimizer && step_in_backward != current.step_in_backward {
                            continue;
                        }
                        let with = |micro_batch: usize, cumulative: usize| Setting {
                            fp16,
                            micro_batch,
                            cumulative,
                            adam,
                            step_in_backward,
                            int8_state,
                            clips: current.clips,
                            offload_activations,
                            offload_optimizer,
                            weight_dtype: current.weight_dtype,
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
    // The nearest measured profile to `setting` among those `like` it, scaled to it.
    let nearest = |setting: &Setting, like: &dyn Fn(&Setting) -> bool| {
        let source = measured
            .iter()
            .filter(|m| like(&m.setting))
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
        Some(scale_timed(
            &source.profile,
            &source.setting,
            setting,
            int8_seconds.unwrap_or(0.0),
            batch_time,
        ))
    };
    let mut candidates: Vec<Candidate> = settings
        .iter()
        .filter_map(|setting| {
            // The device's bytes: a profile measured with the same offload.
            let profile = nearest(setting, &|m: &Setting| {
                m.fp16 == setting.fp16
                    && m.weight_dtype == setting.weight_dtype
                    && m.step_in_backward == setting.step_in_backward
                    && (m.offload_activations, m.offload_optimizer)
                        == (setting.offload_activations, setting.offload_optimizer)
            })?;
            let offload = match staging {
                Some(staging) if setting.offload_activations || setting.offload_optimizer => {
                    // The compute: the same setting without offload (on the host the step taps
                    // as in backward: that profile where there is one).
                    let plain = |in_backward: bool| {
                        move |m: &Setting| {
                            m.fp16 == setting.fp16
                                && m.weight_dtype == setting.weight_dtype
                                && m.step_in_backward == in_backward
                                && !m.offload_activations
                                && !m.offload_optimizer
                        }
                    };
                    let tapped = setting.step_in_backward || setting.offload_optimizer;
                    let compute = nearest(setting, &plain(tapped))
                        .or_else(|| nearest(setting, &plain(setting.step_in_backward)))?;
                    Some((staging, compute))
                }
                _ => None,
            };
            Some(match &offload {
                Some((staging, compute)) => candidate(
                    current,
                    setting,
                    &profile,
                    budget,
                    keys,
                    Some(Offload {
                        staging,
                        compute,
                        cost: OffloadCost {
                            offloaded_bytes: profile.offloaded_bytes,
                            host_step_seconds: profile.host_step_seconds,
                        },
                    }),
                ),
                None => candidate(current, setting, &profile, budget, keys, None),
            })
        })
        .collect();
    // Activation offload moves the checkpointed segments' inputs: with none checkpointed it
    // does nothing, and is not offered.
    candidates.retain(|c| {
        !(c.setting.offload_activations && !current.offload_activations && c.checkpoint.is_empty())
    });
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
            offload_activations: false,
            offload_optimizer: false,
            weight_dtype: Default::default(),
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
        let candidates = advise(&setting(), &measured(), 1150, &KEYS, false, None);
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
        let candidates = advise(&setting(), &measured(), 900, &KEYS, true, None);
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
        let strict = advise(&setting(), &measured(), 900, &KEYS, false, None);
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
        let candidates = advise(&setting(), &measured, 1 << 40, &KEYS, false, None);
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

    fn staging(host_budget: u64, link_bytes_per_second: f64) -> Staging {
        Staging {
            host_budget,
            link_bytes_per_second,
            link_source: "the test".into(),
        }
    }

    /// `measured()` and two profiles measured with offload, in the config's precision and
    /// place of the step: activation offload (every window but the step's 50 bytes lower, 300
    /// bytes of inputs on the host) and optimizer offload (it taps as the step in backward does:
    /// no gradients at the step; Adam's two moments, 400 bytes, off the device; the host's
    /// rule 0.5 s).
    fn measured_with_offload(with_activations: bool, with_optimizer: bool) -> Vec<Measured> {
        let mut measured = measured();
        let mut activations = profile(200, 14.0);
        for window in &mut activations.windows {
            if window.label != "step" {
                window.peak -= 50;
            }
        }
        activations.offloaded_bytes = 300;
        measured.extend(with_activations.then_some(Measured {
            setting: Setting {
                offload_activations: true,
                ..setting()
            },
            profile: activations,
        }));
        let mut optimizer = profile(0, 14.0);
        optimizer.resident -= 400;
        for window in &mut optimizer.windows {
            window.peak -= 400;
        }
        optimizer.host_step_seconds = 0.5;
        measured.extend(with_optimizer.then_some(Measured {
            setting: Setting {
                offload_optimizer: true,
                ..setting()
            },
            profile: optimizer,
        }));
        measured
    }

    #[test]
    fn optimizer_offload_is_offered_where_the_device_stages_and_priced_by_the_link() {
        let optimizer = Setting {
            offload_optimizer: true,
            ..setting()
        };
        // Budget 700: the weights and what a window holds above them, without the moments.
        let at_700 = |staging: Option<&Staging>| {
            advise(
                &setting(),
                &measured_with_offload(true, true),
                700,
                &KEYS,
                false,
                staging,
            )
        };
        let cpu = at_700(None);
        assert!(
            cpu.iter()
                .all(|c| !c.setting.offload_optimizer && !c.setting.offload_activations),
            "no staging (the CPU): no offload"
        );
        assert!(cpu.iter().all(|c| !c.fits), "nothing else fits 700");
        let candidates = at_700(Some(&staging(10_000, 100.0)));
        // First: accumulation with the sums on the host (its micro-batch's activations half,
        // fewer segments checkpointed), the sums' 200 bytes on the host.
        let grouped = &candidates[0];
        assert_eq!(
            grouped.setting,
            Setting {
                micro_batch: 1,
                cumulative: 2,
                ..optimizer
            },
            "{candidates:#?}"
        );
        assert!(grouped.fits && grouped.host_bytes == 800, "{grouped:?}");
        let first = candidates.iter().find(|c| c.setting == optimizer).unwrap();
        assert!(first.fits && first.peak <= 700, "{first:?}");
        assert!(first.label.contains("optimizer offload"), "{}", first.label);
        assert!(first.sets.contains(&"offload.optimizer=true".to_string()));
        // On the host: the fp32 masters (200) and Adam's two moments (400).
        assert_eq!(first.host_bytes, 600);
        // The compute of the step in backward with every segment checkpointed and its norm
        // pass (clipping: 14 + 3 + 5 s), the gradients down and the weights up (400 bytes at
        // 100 a second) and the host's rule (0.5 s).
        assert!(
            (first.seconds - (22.0 + 4.0 + 0.5)).abs() < 1e-9,
            "{}",
            first.seconds
        );
        // The link's bandwidth is read: half of it, twice the copies' time.
        let slow = at_700(Some(&staging(10_000, 50.0)));
        let slow = slow.iter().find(|c| c.setting == optimizer).unwrap();
        assert!(
            (slow.seconds - (22.0 + 8.0 + 0.5)).abs() < 1e-9,
            "{}",
            slow.seconds
        );
        // The host budget is read: 599 bytes cannot hold the masters and the state.
        let tight = at_700(Some(&staging(599, 100.0)));
        let held = tight.iter().find(|c| c.setting == optimizer).unwrap();
        assert!(!held.fits && held.host_bytes == 600, "{held:?}");
        assert!(
            tight.iter().filter(|c| c.setting.adam).all(|c| !c.fits),
            "{tight:#?}"
        );
        // SGD's momentum on the host: one copy of the weights fewer there, none on the device
        // (the offload profile holds no state on it).
        let sgd = tight
            .iter()
            .find(|c| {
                c.setting
                    == Setting {
                        adam: false,
                        ..optimizer
                    }
            })
            .unwrap();
        assert!(
            sgd.fits && sgd.host_bytes == 400 && sgd.peak == first.peak,
            "{sgd:?}"
        );
        // Both offloads together were not measured: not offered.
        assert!(candidates
            .iter()
            .all(|c| !(c.setting.offload_activations && c.setting.offload_optimizer)));
    }

    #[test]
    fn under_optimizer_offload_accumulations_sums_are_host_bytes_and_copies() {
        let offload = Setting {
            offload_optimizer: true,
            ..setting()
        };
        let grouped = Setting {
            micro_batch: 1,
            cumulative: 2,
            ..offload
        };
        let link = staging(10_000, 100.0);
        let compute = profile(0, 14.0);
        let cost = OffloadCost {
            host_step_seconds: 0.5,
            ..OffloadCost::default()
        };
        let all = [true; 4];
        let seconds = |setting: &Setting| link.copy_seconds(setting, &compute, &all, &cost);
        // Alone: the step pass's gradients down, the weights up (200 bytes each at 100 a
        // second), the host's rule.
        assert!(
            (seconds(&offload) - 4.5).abs() < 1e-9,
            "{}",
            seconds(&offload)
        );
        // In groups of two, clipped: both micro-batches and the norm pass copy their gradients
        // down to the sums on the host (3 x 200), the weights up (200).
        assert!(
            (seconds(&grouped) - 8.5).abs() < 1e-9,
            "{}",
            seconds(&grouped)
        );
        // In half precision the gradients cross in half (3 x 100), and so do the new weights
        // (100): the device keeps no fp32 weight.
        let half = Setting {
            fp16: true,
            ..grouped
        };
        assert!((seconds(&half) - 4.5).abs() < 1e-9, "{}", seconds(&half));
        // The host holds the masters (200), Adam's moments (400) and, grouped, the sums (200).
        assert_eq!(Staging::host_bytes(&offload, 200, &all, &cost), 600);
        assert_eq!(Staging::host_bytes(&grouped, 200, &all, &cost), 800);
        // On the device, a profile scaled to groups of two gains the sums without offload, and
        // none with it.
        let step_gradients = |profile: &Profile| {
            profile
                .windows
                .iter()
                .find(|w| w.label == "step")
                .map(|w| w.gradients)
        };
        let grouped_on_device = Setting {
            micro_batch: 1,
            cumulative: 2,
            ..setting()
        };
        let on_device = scale(&profile(0, 14.0), &setting(), &grouped_on_device, 0.0);
        let on_host = scale(&compute, &offload, &grouped, 0.0);
        assert_eq!(step_gradients(&on_device), Some(200));
        assert_eq!(step_gradients(&on_host), Some(0));
    }

    #[test]
    fn activation_offload_costs_only_the_copy_time_the_compute_does_not_hide() {
        let activations = Setting {
            offload_activations: true,
            ..setting()
        };
        // Budget 1080: every plain window holds 1100; with the inputs on the host, 1050 (the
        // step's 1040 is below both).
        let plain = profile(40, 14.0);
        let mut offloaded = plain.clone();
        for window in &mut offloaded.windows {
            if window.label != "step" {
                window.peak -= 50;
            }
        }
        offloaded.offloaded_bytes = 300;
        let measured = vec![
            Measured {
                setting: setting(),
                profile: plain,
            },
            Measured {
                setting: activations,
                profile: offloaded,
            },
        ];
        let at_1080 = |bandwidth: f64, host_budget: u64| {
            advise(
                &setting(),
                &measured,
                1080,
                &KEYS,
                false,
                Some(&staging(host_budget, bandwidth)),
            )
        };
        let priced = |bandwidth: f64, host_budget: u64| {
            let candidates = at_1080(bandwidth, host_budget);
            let first = candidates[0].clone();
            assert_eq!(first.setting, activations, "{candidates:#?}");
            first
        };
        let fast = priced(100.0, 10_000);
        assert!(fast.fits && fast.peak == 1050, "{fast:?}");
        assert_eq!(fast.checkpoint.len(), 4);
        assert!(fast.sets.contains(&"offload.activations=true".to_string()));
        assert_eq!(fast.host_bytes, 300);
        // 300 bytes at 100 a second: 3 s each way, hidden by the forward (3 s) and the four
        // recomputations (4 s): the plain step's 14 s.
        assert!((fast.seconds - 14.0).abs() < 1e-9, "{}", fast.seconds);
        // At 50 bytes a second, 6 s each way: 3 s and 2 s not hidden.
        let slow = priced(50.0, 10_000);
        assert!((slow.seconds - 19.0).abs() < 1e-9, "{}", slow.seconds);
        // A host budget below the 300 bytes offloaded: it does not fit.
        // Activation offload is planned with every segment checkpointed, even where the budget
        // would leave one unchecked (its input would then stay on the device, which the
        // profile's kept bytes do not count); without offload one is left unchecked.
        let roomy = advise(
            &setting(),
            &measured,
            1200,
            &KEYS,
            false,
            Some(&staging(10_000, 100.0)),
        );
        let offloaded = roomy.iter().find(|c| c.setting == activations).unwrap();
        assert_eq!(offloaded.checkpoint.len(), 4, "{offloaded:?}");
        let plain = roomy.iter().find(|c| c.setting == setting()).unwrap();
        assert!(plain.fits && plain.checkpoint.len() == 3, "{plain:?}");
        let candidates = at_1080(100.0, 299);
        let offloaded = candidates
            .iter()
            .find(|c| c.setting == activations)
            .unwrap();
        assert!(
            !offloaded.fits && offloaded.host_bytes == 300,
            "{offloaded:?}"
        );
    }
}
