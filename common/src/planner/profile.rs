//! A profiled step, and the peak and time it predicts for a checkpoint set.
//!
//! The profile is one training step with every segment checkpointed (the least memory
//! checkpointing can give). Its timeline is cut into *windows*: the forward, the backward until
//! the first recomputation, one window per recomputation (from its start to the next one's),
//! and the optimizer step. For each window it keeps the highest live bytes measured in it;
//! for each recomputation, the bytes the segment keeps for backward when it is *not*
//! checkpointed (what its recomputed forward made live, less its output, which exists either
//! way) and its time.
//!
//! A segment left unchecked keeps those bytes from its forward until its backward: in the
//! forward window, the window before the first recomputation, and the windows of every
//! recomputation that runs before its own. So the peak of a checkpoint set S is
//! `max over windows w of (peak(w) + sum of kept(i) for the segments i not in S still alive
//! in w)`, and its step time the profiled time less the recomputations of the segments not in
//! S. The transient of each recomputation is in its window's peak.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::checkpoint::profile::{Boundary, Event};
use crate::checkpoint::SegmentId;

/// A checkpointable segment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentProfile {
    /// Its module path (`backbone.layer2.1`).
    pub path: String,
    /// Its module's type (`Bottleneck`).
    pub kind: String,
    /// Bytes it keeps for backward when not checkpointed (all its calls).
    pub kept_bytes: u64,
    /// Its output's bytes (kept either way).
    pub output_bytes: u64,
    /// The time of its forward in the profiled step (checkpointed: untracked), seconds.
    pub forward_seconds: f64,
    /// The time of its recomputation in backward, seconds: what checkpointing it costs.
    pub recompute_seconds: f64,
    /// How many times it ran in the step (a module called on several inputs is one segment).
    pub calls: usize,
}

/// A stretch of the profiled step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// What ran (`forward`, `backward`, `recompute backbone.layer2.1`, `step`).
    pub label: String,
    /// The highest live bytes in it, everything checkpointed.
    pub peak: u64,
    /// Gradient bytes live as it started (where the allocator's tags tell).
    pub gradients: u64,
    /// Whether its bytes above the resident ones grow with the batch (all but the step's).
    pub batch_scaled: bool,
    /// The calls still holding their activations in it when their segment is not checkpointed:
    /// (segment index, bytes).
    pub alive: Vec<(usize, u64)>,
    /// The recomputations started up to and in this window, with what each one's helper
    /// holds until backward ends: (segment index, bytes). Unchecked, they hold nothing.
    #[serde(default)]
    pub recomputed: Vec<(usize, u64)>,
    /// Of the profile's `growth` (the state a first step makes), the bytes already made when the
    /// window starts: under the optimizer's step in backward, each parameter's state is made as
    /// its gradient arrives, and a later step's window holds only the rest beyond the profiled
    /// one's.
    #[serde(default)]
    pub state_made: u64,
}

/// One profiled step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Live bytes at the step's start: weights, optimizer state, data, runtime.
    pub resident: u64,
    /// Bytes of the trainable parameters (a gradient's, an optimizer state copy's).
    pub trainable: u64,
    /// Gradient bytes live when backward ended.
    pub gradients: u64,
    /// Bytes the step left live that were not there at its start (the optimizer's state, made
    /// by a first step); added to the windows before the step, where later steps hold them.
    pub growth: u64,
    /// The profiled step's time, seconds (everything checkpointed).
    pub step_seconds: f64,
    /// Bytes each recomputation's helper thread frees when it is joined after backward (on the
    /// CPU, the matrix-product library's per-thread scratch): held in every window from its
    /// recomputation on.
    #[serde(default)]
    pub helper_bytes: u64,
    /// The checkpointable segments, in the order of their first forward.
    pub segments: Vec<SegmentProfile>,
    /// Segments that ran but were not checkpointed in the profile (their input needed no
    /// gradient), by path: they cannot be planned.
    pub unplannable: Vec<String>,
    /// The windows, in order.
    pub windows: Vec<Window>,
    /// Whether the gradient bytes are estimated from the parameters (a device meter that
    /// cannot tell gradients from other bytes: CubeCL's pools) rather than counted.
    #[serde(default)]
    pub gradients_estimated: bool,
    /// Seconds of the profiled step's forward (to the loss) and of its backward.
    #[serde(default)]
    pub forward_seconds: f64,
    /// See `forward_seconds`.
    #[serde(default)]
    pub backward_seconds: f64,
    /// Forwards and backwards the step ran: 2 for the optimizer's step in backward under
    /// clipping or mixed precision, whose first pass finds the norm; the windows are the last
    /// pass's, and the first pass's time is `first_pass_seconds`.
    #[serde(default = "one")]
    pub passes: usize,
    /// The first pass's seconds, when there were two (its recomputations included).
    #[serde(default)]
    pub first_pass_seconds: f64,
    /// Under activation offload: the bytes of the segments' inputs copied to host memory in the
    /// profiled pass (each copied down in the forward and up before its recomputation).
    #[serde(default)]
    pub offloaded_bytes: u64,
    /// Under optimizer offload: the seconds of the optimizer's rule on the host in the step
    /// (the copies excluded).
    #[serde(default)]
    pub host_step_seconds: f64,
    /// The link between the device and host memory, measured before the step (bytes a second
    /// each way, the slower of the two); 0 where the device is host memory (the CPU).
    #[serde(default)]
    pub link_bytes_per_second: f64,
}

fn one() -> usize {
    1
}

/// Where the meter cannot tell gradients from other bytes, the gradient bytes live at each
/// boundary of a step, from the trainable parameters in visiting order (`layout`: module path
/// and gradient bytes, each runtime's `trainable_layout`). Backward makes the
/// gradients in the reverse of the forward's order, which the visiting order follows in the
/// models memsave knows: when a segment's recomputation starts, the parameters after its last
/// one have their gradients; when backward ends, all of them.
#[derive(Clone, Debug, Default)]
pub struct GradientEstimate {
    layout: Vec<(String, u64)>,
}

impl GradientEstimate {
    /// The estimate over `layout`.
    pub fn new(layout: Vec<(String, u64)>) -> Self {
        GradientEstimate { layout }
    }

    /// Every gradient's bytes.
    pub fn total(&self) -> u64 {
        self.layout.iter().map(|(_, bytes)| bytes).sum()
    }

    /// The bytes of the gradients made before the recomputation of the segment at `path`
    /// starts: those of the parameters after its last one; `None` for a segment without
    /// trainable parameters of its own (it changes nothing).
    pub fn before_recompute(&self, path: &str) -> Option<u64> {
        let prefix = format!("{path}.");
        let last = self
            .layout
            .iter()
            .rposition(|(p, _)| p == path || p.starts_with(&prefix))?;
        Some(self.layout[last + 1..].iter().map(|(_, bytes)| bytes).sum())
    }
}

impl Profile {
    /// The profile of a step's `events` (from [`crate::checkpoint::profile`], recorded with every
    /// segment checkpointed), its segments named by `paths` (from
    /// [`crate::checkpoint::CheckpointModule::visit_segments`] on the model that ran the
    /// forward). `trainable`: the bytes of the trainable parameters. Where the events carry no
    /// gradient bytes (an untagged meter), `estimate` gives them.
    pub fn from_events(
        events: &[Event],
        paths: &HashMap<SegmentId, String>,
        trainable: u64,
        estimate: &GradientEstimate,
    ) -> Profile {
        let name = |id: &SegmentId| {
            paths
                .get(id)
                .cloned()
                .unwrap_or_else(|| format!("<{}>", id.type_name()))
        };
        let mut segments: Vec<SegmentProfile> = Vec::new();
        let mut index_of: HashMap<SegmentId, usize> = HashMap::new();
        // Per segment, the outputs of its checkpointed forwards not yet matched (last first).
        let mut outputs: HashMap<SegmentId, Vec<u64>> = HashMap::new();
        let mut unplannable = Vec::new();
        for event in events {
            if let Event::Forward {
                id,
                before,
                after,
                seconds,
                checkpointed,
            } = event
            {
                if !checkpointed {
                    let path = name(id);
                    if !unplannable.contains(&path) {
                        unplannable.push(path);
                    }
                    continue;
                }
                let index = *index_of.entry(*id).or_insert_with(|| {
                    segments.push(SegmentProfile {
                        path: name(id),
                        kind: id.type_name(),
                        kept_bytes: 0,
                        output_bytes: 0,
                        forward_seconds: 0.0,
                        recompute_seconds: 0.0,
                        calls: 0,
                    });
                    segments.len() - 1
                });
                let output = after.saturating_sub(*before);
                let segment = &mut segments[index];
                segment.output_bytes += output;
                segment.forward_seconds += seconds;
                segment.calls += 1;
                outputs.entry(*id).or_default().push(output);
            }
        }
        unplannable.retain(|path| !segments.iter().any(|s| &s.path == path));

        // Each recomputation: its segment and kept bytes.
        let mut recomputed: Vec<(usize, u64)> = Vec::new();
        for event in events {
            if let Event::Recompute {
                id,
                before,
                after,
                seconds,
                ..
            } = event
            {
                let Some(&index) = index_of.get(id) else {
                    continue;
                };
                let output = outputs.get_mut(id).and_then(Vec::pop).unwrap_or(0);
                let kept = after.saturating_sub(*before).saturating_sub(output);
                segments[index].kept_bytes += kept;
                segments[index].recompute_seconds += seconds;
                recomputed.push((index, kept));
            }
        }

        // The windows: each starts at an event and takes its peak from the next one's.
        let mut windows: Vec<Window> = Vec::new();
        let mut label = "forward".to_string();
        let mut alive: Vec<(usize, u64)> = recomputed.clone();
        let mut batch_scaled = true;
        let mut window_gradients = 0;
        // Parameter bytes whose gradients backward made before the window (the estimate's order).
        let (mut stepped, mut window_stepped) = (Vec::new(), 0);
        let mut backward_live = None;
        let mut next_recompute = 0;
        let mut done: Vec<(usize, u64)> = Vec::new();
        let mut helper_bytes = 0;
        let (mut resident, mut first_seconds, mut last_seconds) = (None, None, 0.0);
        let (mut forward_end, mut backward_end) = (None, None);
        let (mut end_live, mut backward_gradients) = (None, 0);
        let mut estimated = false;
        for event in events {
            // The recomputations held in the window this event closes.
            let mut held = done.clone();
            let mut next_stepped = None;
            let (peak, next_label, gradients) = match event {
                Event::Forward { .. } => continue,
                Event::Joined {
                    helpers,
                    before,
                    after,
                } => {
                    helper_bytes = before.saturating_sub(*after) / (*helpers).max(1) as u64;
                    continue;
                }
                Event::Released { id, held } => {
                    // Charged to the window of its recomputation and every later one.
                    if let (Some(&index), Some(last)) = (index_of.get(id), done.last_mut()) {
                        if last.0 == index {
                            last.1 += held;
                        }
                    }
                    continue;
                }
                Event::Boundary {
                    at,
                    window_peak,
                    live,
                    gradients,
                    seconds,
                } => {
                    first_seconds.get_or_insert(*seconds);
                    last_seconds = *seconds;
                    match at {
                        Boundary::Start => {
                            resident = Some(*live);
                            continue;
                        }
                        Boundary::ForwardEnd => {
                            forward_end.get_or_insert(*seconds);
                            estimated |= gradients.is_none();
                            (*window_peak, "backward".to_string(), gradients.or(Some(0)))
                        }
                        Boundary::BackwardEnd => {
                            backward_end.get_or_insert(*seconds);
                            backward_live.get_or_insert(*live);
                            let gradients = gradients.unwrap_or_else(|| estimate.total());
                            backward_gradients = gradients;
                            (*window_peak, "step".to_string(), Some(gradients))
                        }
                        Boundary::End => {
                            end_live = Some(*live);
                            (*window_peak, String::new(), *gradients)
                        }
                    }
                }
                Event::Recompute {
                    id,
                    window_peak,
                    gradients,
                    ..
                } => {
                    if let Some(&index) = index_of.get(id) {
                        next_recompute += 1;
                        done.push((index, 0));
                    }
                    held = done[..done.len().saturating_sub(1)].to_vec();
                    let path = name(id);
                    next_stepped = estimate.before_recompute(&path);
                    let gradients = gradients
                        .or_else(|| estimate.before_recompute(&path))
                        .or(Some(window_gradients));
                    (*window_peak, format!("recompute {path}"), gradients)
                }
            };
            windows.push(Window {
                label: std::mem::replace(&mut label, next_label.clone()),
                peak,
                gradients: window_gradients,
                batch_scaled,
                alive: alive.clone(),
                recomputed: std::mem::take(&mut held),
                state_made: 0,
            });
            stepped.push(window_stepped);
            if next_label == "step" {
                window_stepped = estimate.total();
            } else if let Some(made) = next_stepped {
                window_stepped = made;
            }
            window_gradients = gradients.unwrap_or(0);
            if next_label == "step" {
                alive.clear();
                done.clear();
                batch_scaled = false;
            } else if next_label.starts_with("recompute") {
                // From this recomputation on, only those still to come hold theirs.
                alive = recomputed[next_recompute.min(recomputed.len())..].to_vec();
            }
            if next_label.is_empty() {
                break;
            }
        }
        let resident = resident.unwrap_or(0);
        let growth = end_live.map_or(0, |end| end.saturating_sub(resident));
        // The state made in backward (the optimizer's step in backward): what was live when it
        // ended beyond the start and the gradients then live; each window has made the share of
        // it of the parameters whose gradients came before it. A step after backward leaves
        // only a few MiB of the forward's leftovers there (ResNet-50: 4.3 of 96.3): below half
        // the growth, none is taken as made.
        let in_backward = backward_live
            .map_or(0, |live| live.saturating_sub(resident + backward_gradients))
            .min(growth);
        let in_backward = if in_backward * 2 >= growth {
            in_backward
        } else {
            0
        };
        let total = estimate.total().max(1);
        for (window, stepped) in windows.iter_mut().zip(stepped) {
            window.state_made =
                (in_backward as u128 * stepped.min(total) as u128 / total as u128) as u64;
        }
        Profile {
            resident,
            trainable,
            gradients: backward_gradients,
            growth,
            step_seconds: last_seconds - first_seconds.unwrap_or(last_seconds),
            helper_bytes,
            segments,
            unplannable,
            windows,
            gradients_estimated: estimated,
            forward_seconds: forward_end
                .zip(first_seconds)
                .map_or(0.0, |(end, start)| end - start),
            backward_seconds: backward_end
                .zip(forward_end)
                .map_or(0.0, |(end, start)| end - start),
            passes: 1,
            first_pass_seconds: 0.0,
            offloaded_bytes: 0,
            host_step_seconds: 0.0,
            link_bytes_per_second: 0.0,
        }
    }

    /// The peak predicted with the segments `checkpointed` (one flag per segment) and the rest
    /// keeping their activations.
    pub fn predict_peak(&self, checkpointed: &[bool]) -> u64 {
        self.window_peaks(checkpointed)
            .into_iter()
            .max()
            .unwrap_or(self.resident)
    }

    /// [`Profile::predict_peak`] window by window.
    pub fn window_peaks(&self, checkpointed: &[bool]) -> Vec<u64> {
        self.windows
            .iter()
            .map(|window| {
                let unchecked = |index: &usize| !checkpointed.get(*index).copied().unwrap_or(false);
                let kept: u64 = window
                    .alive
                    .iter()
                    .filter(|(index, _)| unchecked(index))
                    .map(|(_, bytes)| bytes)
                    .sum();
                // An unchecked segment starts no helper thread.
                let held: u64 = window
                    .recomputed
                    .iter()
                    .filter(|(index, _)| unchecked(index))
                    .map(|(_, held)| (*held).max(self.helper_bytes))
                    .sum();
                (window.peak + kept + self.carried(window)).saturating_sub(held)
            })
            .collect()
    }

    /// What a later step holds in `window` that the profiled one did not (the optimizer state
    /// a first step makes).
    pub fn carried(&self, window: &Window) -> u64 {
        if window.batch_scaled {
            self.growth.saturating_sub(window.state_made)
        } else {
            0
        }
    }

    /// The step time predicted with the segments `checkpointed` (each pass recomputes them).
    pub fn predict_seconds(&self, checkpointed: &[bool]) -> f64 {
        let saved: f64 = self
            .segments
            .iter()
            .enumerate()
            .filter(|(index, _)| !checkpointed.get(*index).copied().unwrap_or(false))
            .map(|(_, segment)| segment.recompute_seconds)
            .sum();
        let passes = self.passes.max(1) as f64;
        (self.step_seconds + self.first_pass_seconds - saved * passes).max(0.0)
    }

    /// The peak without checkpointing.
    pub fn unplanned_peak(&self) -> u64 {
        self.predict_peak(&[])
    }

    /// The peak with every segment checkpointed: the least checkpointing can do.
    pub fn floor(&self) -> u64 {
        self.predict_peak(&vec![true; self.segments.len()])
    }

    /// Flags for the segments whose paths are in `paths`.
    pub fn flags(&self, paths: &[String]) -> Vec<bool> {
        self.segments
            .iter()
            .map(|segment| paths.contains(&segment.path))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boundary(at: Boundary, window_peak: u64, gradients: Option<u64>) -> Event {
        Event::Boundary {
            at,
            window_peak,
            live: window_peak,
            gradients,
            seconds: 0.0,
        }
    }

    /// Two checkpointed segments (`a` then `b`) and a head after them; the meter `tagged` or
    /// not.
    fn events(tagged: bool) -> (Vec<Event>, HashMap<SegmentId, String>) {
        let (a, b) = (1u8, 2u16);
        let (a, b) = (SegmentId::of(&a), SegmentId::of(&b));
        let forward = |id| Event::Forward {
            id,
            before: 0,
            after: 10,
            seconds: 0.0,
            checkpointed: true,
        };
        let recompute = |id, gradients| Event::Recompute {
            id,
            window_peak: 500,
            before: 0,
            after: 50,
            gradients: tagged.then_some(gradients),
            seconds: 0.0,
        };
        let events = vec![
            boundary(Boundary::Start, 100, tagged.then_some(0)),
            forward(a),
            forward(b),
            boundary(Boundary::ForwardEnd, 400, tagged.then_some(0)),
            recompute(b, 7),
            recompute(a, 27),
            boundary(Boundary::BackwardEnd, 300, tagged.then_some(61)),
            boundary(Boundary::End, 200, tagged.then_some(0)),
        ];
        let paths = HashMap::from([(a, "a".to_string()), (b, "b".to_string())]);
        (events, paths)
    }

    fn estimate() -> GradientEstimate {
        GradientEstimate::new(vec![
            ("a.conv".into(), 4),
            ("a.norm".into(), 1),
            ("b.conv".into(), 16),
            ("b.norm".into(), 4),
            ("head".into(), 8),
        ])
    }

    #[test]
    fn an_untagged_meters_gradients_are_estimated_from_the_parameters_in_backward_order() {
        let estimate = estimate();
        assert_eq!(estimate.total(), 33);
        assert_eq!(estimate.before_recompute("b"), Some(8), "the head's");
        assert_eq!(
            estimate.before_recompute("a"),
            Some(28),
            "b's and the head's"
        );
        assert_eq!(
            estimate.before_recompute("c"),
            None,
            "no parameter of its own"
        );

        let (events, paths) = events(false);
        let profile = Profile::from_events(&events, &paths, 33, &estimate);
        assert!(profile.gradients_estimated);
        let gradients: Vec<(&str, u64)> = profile
            .windows
            .iter()
            .map(|w| (w.label.as_str(), w.gradients))
            .collect();
        assert_eq!(
            gradients,
            [
                ("forward", 0),
                ("backward", 0),
                ("recompute b", 8),
                ("recompute a", 28),
                ("step", 33)
            ]
        );
        assert_eq!(profile.gradients, 33);
    }

    #[test]
    fn a_tagged_meters_counted_gradients_are_kept_as_they_are() {
        let (events, paths) = events(true);
        let profile = Profile::from_events(&events, &paths, 33, &estimate());
        assert!(!profile.gradients_estimated);
        let gradients: Vec<u64> = profile.windows.iter().map(|w| w.gradients).collect();
        assert_eq!(gradients, [0, 0, 7, 27, 61]);
        assert_eq!(profile.gradients, 61);
    }

    /// The fixture's step with its state (66 bytes) made in backward, as the optimizer's step
    /// in backward does, or after it.
    fn with_state(in_backward: bool) -> (Vec<Event>, HashMap<SegmentId, String>) {
        let (mut events, paths) = events(true);
        for event in &mut events {
            if let Event::Boundary {
                at,
                live,
                gradients,
                ..
            } = event
            {
                match at {
                    Boundary::Start => *live = 100,
                    Boundary::BackwardEnd if in_backward => (*live, *gradients) = (166, Some(0)),
                    Boundary::BackwardEnd => (*live, *gradients) = (161, Some(61)),
                    Boundary::End => *live = 166,
                    _ => {}
                }
            }
        }
        (events, paths)
    }

    #[test]
    fn state_made_in_backward_is_carried_only_by_the_windows_before_it() {
        let (events, paths) = with_state(true);
        let made = Profile::from_events(&events, &paths, 33, &estimate());
        assert_eq!(made.growth, 66);
        let state: Vec<u64> = made.windows.iter().map(|w| w.state_made).collect();
        // b's recomputation comes after the head's 8 of 33 bytes of parameters, a's after 28.
        assert_eq!(state, [0, 0, 16, 56, 66]);
        let carried: Vec<u64> = made.windows.iter().map(|w| made.carried(w)).collect();
        assert_eq!(carried, [66, 66, 50, 10, 0]);

        let (events, paths) = with_state(false);
        let after = Profile::from_events(&events, &paths, 33, &estimate());
        assert_eq!(after.growth, 66);
        let carried: Vec<u64> = after.windows.iter().map(|w| after.carried(w)).collect();
        assert_eq!(
            carried,
            [66, 66, 66, 66, 0],
            "made in the step: every window before it"
        );
    }
}
