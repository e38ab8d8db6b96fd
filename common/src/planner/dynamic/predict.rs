//! What `"dynamic"` predicts from a profile: the profile scaled to another input size, the
//! least a step takes with segments recomputed or their inputs in host memory, and the figures
//! of a logging interval.

use std::collections::BTreeMap;

use crate::human_bytes as human;
use crate::planner::Profile;

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
pub(super) const PREFETCH: usize = 2;

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
pub(super) fn least(at: &Profile, inputs: &[u64], staged: bool) -> u64 {
    if staged {
        floor_offloaded(at, inputs, &vec![true; at.segments.len()])
    } else {
        at.floor()
    }
}
