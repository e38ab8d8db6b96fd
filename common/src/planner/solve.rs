//! The checkpoint set that fits a budget at the least recomputation time.
//!
//! A segment left unchecked adds its kept bytes to the windows from its forward to its own
//! backward; those windows' sets of live activations are suffixes of the recomputation order
//! (see [`super::profile`]). So a dynamic program over that order, keeping the Pareto front of
//! (bytes kept, seconds of recomputation) of the decisions so far and dropping every state that
//! some window already cannot hold, finds the exact optimum. A segment called several times
//! (one module on several inputs) is one decision for all its calls: up to
//! `MAX_ENUMERATED` such segments are enumerated around the program; beyond that they are
//! decided greedily, and the plan says it is not exact. A front larger than `MAX_FRONT`
//! states is thinned to the cheapest state per 1/65536 of the budget (also not exact).

use std::rc::Rc;

use super::profile::Profile;

/// Segments called several times that are enumerated exactly.
pub(crate) const MAX_ENUMERATED: usize = 10;
/// Pareto states kept before thinning.
pub(crate) const MAX_FRONT: usize = 200_000;

/// A checkpoint set and what it is predicted to cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Per segment of the profile: checkpointed or not.
    pub checkpointed: Vec<bool>,
    /// The checkpointed segments' paths.
    pub paths: Vec<String>,
    /// The predicted peak, bytes.
    pub peak: u64,
    /// The predicted step time, seconds.
    pub seconds: f64,
    /// Whether the plan is the proven optimum (else a greedy or thinned search found it).
    pub exact: bool,
}

/// Why no checkpoint set fits.
#[derive(Clone, Debug, PartialEq)]
pub struct BelowFloor {
    /// The budget, bytes.
    pub budget: u64,
    /// The least peak checkpointing can give: every segment checkpointed.
    pub floor: u64,
}

impl std::fmt::Display for BelowFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the budget of {} ({} bytes) is below the floor of checkpointing: {} ({} bytes) with \
             every segment checkpointed",
            crate::human_bytes(self.budget),
            self.budget,
            crate::human_bytes(self.floor),
            self.floor
        )
    }
}

#[derive(Clone)]
struct Node {
    item: usize,
    on: bool,
    next: Option<Rc<Node>>,
}

#[derive(Clone)]
struct State {
    kept: u64,
    cost: f64,
    choices: Option<Rc<Node>>,
}

/// One call of a segment, in recomputation order.
struct Item {
    segment: usize,
    bytes: u64,
    seconds: f64,
}

/// The cheapest checkpoint set whose predicted peak is at most `budget`.
///
/// The program works on the windows' peaks as measured with every segment checkpointed. What a
/// recomputation's helper holds until backward ends (see `Profile::predict_peak`) is not
/// there for an unchecked segment; where the profile has such bytes, the program's answer is
/// then improved by unchecking segments while the full prediction allows, and, where the
/// program finds nothing (checkpointing everything is then not the least memory), a greedy
/// search from no checkpointing at all is tried; either makes the plan not proven optimal.
pub fn plan(profile: &Profile, budget: u64) -> Result<Plan, BelowFloor> {
    let held = profile.windows.iter().any(|w| {
        !w.recomputed.is_empty()
            && (profile.helper_bytes > 0 || w.recomputed.iter().any(|r| r.1 > 0))
    });
    match program_plan(profile, budget) {
        Ok(plan) if held => Ok(improve(profile, budget, plan)),
        Ok(plan) => Ok(plan),
        Err(below) => {
            let none = vec![false; profile.segments.len()];
            let mut least = below.floor.min(profile.predict_peak(&none));
            if held {
                match grow(profile, budget) {
                    Ok(plan) => return Ok(improve(profile, budget, plan)),
                    Err(found) => least = least.min(found),
                }
            }
            Err(BelowFloor {
                budget,
                floor: least,
            })
        }
    }
}

/// Unchecks segments, the most expensive first, while the prediction stays within `budget`.
fn improve(profile: &Profile, budget: u64, plan: Plan) -> Plan {
    let mut checkpointed = plan.checkpointed.clone();
    let mut order: Vec<usize> = (0..checkpointed.len())
        .filter(|&s| checkpointed[s])
        .collect();
    order.sort_by(|&a, &b| {
        profile.segments[b]
            .recompute_seconds
            .total_cmp(&profile.segments[a].recompute_seconds)
    });
    let mut changed = false;
    for s in order {
        checkpointed[s] = false;
        if profile.predict_peak(&checkpointed) <= budget {
            changed = true;
        } else {
            checkpointed[s] = true;
        }
    }
    let exact = plan.exact && !changed;
    let mut plan = finish(profile, checkpointed, exact);
    plan.exact = exact;
    plan
}

/// From nothing checkpointed, checks the segment that lowers the predicted peak most per
/// second of recomputation until it fits `budget`; `Err` with the least peak reached if it
/// does not.
fn grow(profile: &Profile, budget: u64) -> Result<Plan, u64> {
    let n = profile.segments.len();
    let mut checkpointed = vec![false; n];
    let mut peak = profile.predict_peak(&checkpointed);
    while peak > budget {
        let mut best: Option<(f64, usize, u64)> = None;
        for s in 0..n {
            if checkpointed[s] {
                continue;
            }
            checkpointed[s] = true;
            let next = profile.predict_peak(&checkpointed);
            checkpointed[s] = false;
            if next < peak {
                let gain = (peak - next) as f64 / profile.segments[s].recompute_seconds.max(1e-9);
                if best.is_none_or(|(g, _, _)| gain > g) {
                    best = Some((gain, s, next));
                }
            }
        }
        let Some((_, s, next)) = best else {
            return Err(peak);
        };
        checkpointed[s] = true;
        peak = next;
    }
    Ok(finish(profile, checkpointed, false))
}

/// The dynamic program's plan (with the windows as measured, everything checkpointed).
fn program_plan(profile: &Profile, budget: u64) -> Result<Plan, BelowFloor> {
    let floor = profile.floor();
    if floor > budget {
        return Err(BelowFloor { budget, floor });
    }
    let n_segments = profile.segments.len();
    // The items: the calls in recomputation order (the backward window holds them all).
    let all = profile
        .windows
        .iter()
        .map(|w| &w.alive)
        .max_by_key(|alive| alive.len())
        .cloned()
        .unwrap_or_default();
    let items: Vec<Item> = all
        .iter()
        .map(|&(segment, bytes)| {
            let s = &profile.segments[segment];
            Item {
                segment,
                bytes,
                seconds: s.recompute_seconds / s.calls.max(1) as f64,
            }
        })
        .collect();
    // Each window: where its suffix of items starts, and what it can still hold.
    let mut checks: Vec<(usize, u64)> = Vec::new();
    let mut suffixes = true;
    for window in &profile.windows {
        let start = items.len() - window.alive.len().min(items.len());
        suffixes &= all[start..] == window.alive[..];
        let fixed = window.peak + profile.carried(window);
        checks.push((start, budget.saturating_sub(fixed)));
    }
    let multi: Vec<usize> = (0..n_segments)
        .filter(|&s| items.iter().filter(|i| i.segment == s).count() > 1)
        .collect();
    if !suffixes {
        return Ok(greedy(profile, budget, &vec![true; n_segments]));
    }

    let mut best: Option<Plan> = None;
    let mut exact = multi.len() <= MAX_ENUMERATED;
    let assignments: Vec<Vec<Option<bool>>> = if exact {
        (0..1u64 << multi.len())
            .map(|mask| {
                let mut forced = vec![None; n_segments];
                for (bit, &segment) in multi.iter().enumerate() {
                    forced[segment] = Some(mask >> bit & 1 == 1);
                }
                forced
            })
            .collect()
    } else {
        // Greedy for the shared segments, the others checkpointed meanwhile.
        let candidates: Vec<bool> = (0..n_segments).map(|s| multi.contains(&s)).collect();
        let greedy_plan = greedy(profile, budget, &candidates);
        vec![(0..n_segments)
            .map(|s| multi.contains(&s).then(|| greedy_plan.checkpointed[s]))
            .collect()]
    };
    for forced in assignments {
        if let Some((plan, thinned)) = program(profile, &items, &checks, &forced, budget) {
            exact &= !thinned;
            let better = best.as_ref().is_none_or(|b| {
                plan.seconds < b.seconds - 1e-12
                    || (plan.seconds <= b.seconds + 1e-12 && plan.peak < b.peak)
            });
            if better {
                best = Some(plan);
            }
        }
    }
    let mut plan = best.unwrap_or_else(|| greedy(profile, budget, &vec![true; n_segments]));
    plan.exact = exact && plan.exact;
    Ok(plan)
}

/// The dynamic program over `items` (last first), with the segments in `forced` decided.
fn program(
    profile: &Profile,
    items: &[Item],
    checks: &[(usize, u64)],
    forced: &[Option<bool>],
    budget: u64,
) -> Option<(Plan, bool)> {
    let n = items.len();
    // The least a window starting at or before position m can hold: a prefix minimum.
    let mut cap_upto = vec![u64::MAX; n + 1];
    for &(start, cap) in checks {
        cap_upto[start] = cap_upto[start].min(cap);
    }
    for m in 1..=n {
        cap_upto[m] = cap_upto[m].min(cap_upto[m - 1]);
    }
    let mut front = vec![State {
        kept: 0,
        cost: 0.0,
        choices: None,
    }];
    if front[0].kept > cap_upto[n] {
        return None;
    }
    let mut thinned = false;
    for m in (0..n).rev() {
        let item = &items[m];
        let options: &[bool] = match forced.get(item.segment).copied().flatten() {
            Some(true) => &[true],
            Some(false) => &[false],
            None => &[true, false],
        };
        let mut next = Vec::with_capacity(front.len() * options.len());
        for state in &front {
            for &on in options {
                let (kept, cost) = if on {
                    (state.kept, state.cost + item.seconds)
                } else {
                    (state.kept + item.bytes, state.cost)
                };
                if kept > cap_upto[m] {
                    continue;
                }
                next.push(State {
                    kept,
                    cost,
                    choices: Some(Rc::new(Node {
                        item: m,
                        on,
                        next: state.choices.clone(),
                    })),
                });
            }
        }
        next.sort_by(|a, b| a.kept.cmp(&b.kept).then(a.cost.total_cmp(&b.cost)));
        let mut pruned: Vec<State> = Vec::with_capacity(next.len());
        for state in next {
            if pruned
                .last()
                .is_none_or(|last| state.cost < last.cost - 1e-12)
            {
                pruned.push(state);
            }
        }
        if pruned.len() > MAX_FRONT {
            thinned = true;
            let grain = (budget / 65536).max(1);
            let mut thin: Vec<State> = Vec::new();
            for state in pruned {
                match thin.last() {
                    Some(last) if last.kept / grain == state.kept / grain => {}
                    _ => thin.push(state),
                }
            }
            pruned = thin;
        }
        if pruned.is_empty() {
            return None;
        }
        front = pruned;
    }
    let best = front
        .into_iter()
        .min_by(|a, b| a.cost.total_cmp(&b.cost).then(a.kept.cmp(&b.kept)))?;
    let mut checkpointed = vec![false; profile.segments.len()];
    let mut node = best.choices;
    while let Some(current) = node {
        if current.on {
            checkpointed[items[current.item].segment] = true;
        }
        node = current.next.clone();
    }
    for (segment, decided) in forced.iter().enumerate() {
        if let Some(on) = decided {
            checkpointed[segment] = *on;
        }
    }
    Some((finish(profile, checkpointed, true), thinned))
}

/// From every segment checkpointed, unchecks the `candidates` in order of seconds saved per
/// byte kept while the predicted peak stays within `budget`.
fn greedy(profile: &Profile, budget: u64, candidates: &[bool]) -> Plan {
    let mut checkpointed = vec![true; profile.segments.len()];
    let mut order: Vec<usize> = (0..profile.segments.len())
        .filter(|&s| candidates[s])
        .collect();
    let ratio = |s: usize| {
        let segment = &profile.segments[s];
        segment.recompute_seconds / (segment.kept_bytes.max(1) as f64)
    };
    order.sort_by(|&a, &b| ratio(b).total_cmp(&ratio(a)));
    for s in order {
        checkpointed[s] = false;
        if profile.predict_peak(&checkpointed) > budget {
            checkpointed[s] = true;
        }
    }
    finish(profile, checkpointed, false)
}

fn finish(profile: &Profile, checkpointed: Vec<bool>, exact: bool) -> Plan {
    Plan {
        paths: profile
            .segments
            .iter()
            .zip(&checkpointed)
            .filter(|(_, on)| **on)
            .map(|(segment, _)| segment.path.clone())
            .collect(),
        peak: profile.predict_peak(&checkpointed),
        seconds: profile.predict_seconds(&checkpointed),
        checkpointed,
        exact,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::profile::{SegmentProfile, Window};
    use super::*;

    /// A chain of segments (recomputed last first): each keeps `kept[i]` bytes unchecked and
    /// costs `seconds[i]` to recompute; `recompute_peaks[i]` is the peak of its recomputation's
    /// window, all checkpointed; the forward, backward and step windows peak at the others.
    pub(crate) fn chain(
        kept: &[u64],
        seconds: &[f64],
        recompute_peaks: &[u64],
        forward: u64,
        backward: u64,
        step: u64,
    ) -> Profile {
        let n = kept.len();
        let segments = (0..n)
            .map(|i| SegmentProfile {
                path: format!("layer.{i}"),
                kind: "Block".into(),
                kept_bytes: kept[i],
                output_bytes: 0,
                forward_seconds: seconds[i],
                recompute_seconds: seconds[i],
                calls: 1,
            })
            .collect();
        let order: Vec<(usize, u64)> = (0..n).rev().map(|i| (i, kept[i])).collect();
        let mut windows = vec![
            Window {
                label: "forward".into(),
                peak: forward,
                gradients: 0,
                batch_scaled: true,
                alive: order.clone(),
                recomputed: Vec::new(),
                state_made: 0,
            },
            Window {
                label: "backward".into(),
                peak: backward,
                gradients: 0,
                batch_scaled: true,
                alive: order.clone(),
                recomputed: Vec::new(),
                state_made: 0,
            },
        ];
        for (k, &(i, _)) in order.iter().enumerate() {
            windows.push(Window {
                label: format!("recompute layer.{i}"),
                peak: recompute_peaks[i],
                gradients: 0,
                batch_scaled: true,
                alive: order[k + 1..].to_vec(),
                recomputed: Vec::new(),
                state_made: 0,
            });
        }
        windows.push(Window {
            label: "step".into(),
            peak: step,
            gradients: 0,
            batch_scaled: false,
            alive: Vec::new(),
            recomputed: Vec::new(),
            state_made: 0,
        });
        Profile {
            resident: 0,
            trainable: 0,
            gradients: 0,
            growth: 0,
            step_seconds: 10.0 + seconds.iter().sum::<f64>(),
            helper_bytes: 0,
            segments,
            unplannable: Vec::new(),
            windows,
            gradients_estimated: false,
            forward_seconds: 0.0,
            backward_seconds: 0.0,
            passes: 1,
            first_pass_seconds: 0.0,
            offloaded_bytes: 0,
            host_step_seconds: 0.0,
            link_bytes_per_second: 0.0,
        }
    }

    /// The cheapest feasible set by trying every one.
    fn brute_force(profile: &Profile, budget: u64) -> Option<f64> {
        let n = profile.segments.len();
        (0..1u32 << n)
            .filter_map(|mask| {
                let flags: Vec<bool> = (0..n).map(|i| mask >> i & 1 == 1).collect();
                (profile.predict_peak(&flags) <= budget).then(|| profile.predict_seconds(&flags))
            })
            .min_by(f64::total_cmp)
    }

    #[test]
    fn a_known_optimum_is_found() {
        // Early blocks: much memory, little time; checkpointing 0 and 1 is the cheapest way
        // under 1000 (checkpointing 3 alone would save only 100 bytes for 5 s).
        let profile = chain(
            &[400, 300, 100, 100],
            &[1.0, 1.0, 1.0, 5.0],
            &[500, 400, 200, 200],
            300,
            300,
            400,
        );
        assert_eq!(profile.unplanned_peak(), 1200);
        let plan = plan(&profile, 1000).unwrap();
        assert!(plan.exact);
        assert_eq!(plan.paths, vec!["layer.0".to_string()]);
        assert_eq!(plan.peak, 800);
        assert!((plan.seconds - (profile.step_seconds - 7.0)).abs() < 1e-9);
        // Tighter: 0 and 1.
        let plan = plan_or_panic(&profile, 700);
        assert_eq!(
            plan.paths,
            vec!["layer.0".to_string(), "layer.1".to_string()]
        );
        // Nothing needed.
        assert!(plan_or_panic(&profile, 5000).paths.is_empty());
    }

    fn plan_or_panic(profile: &Profile, budget: u64) -> Plan {
        plan(profile, budget).unwrap()
    }

    #[test]
    fn the_recomputation_transient_counts() {
        // Segment 0 is the biggest; checkpointing it makes its recomputation's window peak at
        // 900, over a budget of 850 which the bytes alone would meet.
        let profile = chain(&[500, 100], &[1.0, 1.0], &[900, 200], 100, 100, 100);
        let error = plan(&profile, 850).unwrap_err();
        assert_eq!(error.floor, 900);
        assert!(error.to_string().contains("900 bytes"), "{error}");
        assert!(plan(&profile, 900).is_ok());
    }

    #[test]
    fn the_program_matches_brute_force() {
        // A fixed pseudo-random sequence: 200 profiles of up to 12 segments.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |range: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % range
        };
        for _ in 0..200 {
            let n = 1 + next(12) as usize;
            let kept: Vec<u64> = (0..n).map(|_| 1 + next(1000)).collect();
            let seconds: Vec<f64> = (0..n).map(|_| 0.1 + next(100) as f64 / 10.0).collect();
            let peaks: Vec<u64> = (0..n).map(|i| kept[i] + next(2000)).collect();
            let profile = chain(&kept, &seconds, &peaks, next(3000), next(3000), next(3000));
            let floor = profile.floor();
            let budget = floor + next(profile.unplanned_peak() - floor + 1);
            let found = plan(&profile, budget).unwrap();
            assert!(found.peak <= budget);
            let best = brute_force(&profile, budget).unwrap();
            assert!(
                (found.seconds - best).abs() < 1e-9,
                "{n} segments, budget {budget}: {} against {best}",
                found.seconds
            );
            assert!(found.exact);
        }
    }
}
