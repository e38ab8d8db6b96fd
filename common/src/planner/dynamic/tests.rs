use super::*;
use crate::planner::{SegmentProfile, Window};

/// Two segments of 100 bytes kept each, 1 s of recomputation each, over 1000 resident.
fn profile() -> Profile {
    let segment = |path: &str| SegmentProfile {
        path: path.into(),
        kind: "Block".into(),
        kept_bytes: 100,
        output_bytes: 10,
        forward_seconds: 1.0,
        recompute_seconds: 1.0,
        calls: 1,
    };
    let window = |label: &str, peak: u64, alive: Vec<(usize, u64)>| Window {
        label: label.into(),
        peak,
        gradients: 0,
        batch_scaled: true,
        alive,
        recomputed: Vec::new(),
        state_made: 0,
    };
    Profile {
        resident: 1000,
        trainable: 0,
        gradients: 0,
        growth: 0,
        step_seconds: 10.0,
        helper_bytes: 0,
        segments: vec![segment("a"), segment("b")],
        unplannable: Vec::new(),
        windows: vec![
            window("forward", 1050, vec![(0, 100), (1, 100)]),
            window("backward", 1050, vec![(0, 100), (1, 100)]),
        ],
        gradients_estimated: false,
        forward_seconds: 4.0,
        backward_seconds: 6.0,
        passes: 1,
        first_pass_seconds: 0.0,
        offloaded_bytes: 0,
        host_step_seconds: 0.0,
        link_bytes_per_second: 0.0,
    }
}

#[test]
fn offloading_takes_the_inputs_off_where_they_wait_and_the_largest_first() {
    // Four segments in forward order, inputs of 40, 10, 30, 20 bytes; with every one
    // recomputed the backward window peaks at 1300 and each recomputation lower.
    let mut at = profile();
    let segment = at.segments[0].clone();
    at.segments = ["a", "b", "c", "d"]
        .iter()
        .map(|path| SegmentProfile {
            path: path.to_string(),
            ..segment.clone()
        })
        .collect();
    let window = |label: &str, peak: u64| Window {
        label: label.into(),
        peak,
        gradients: 0,
        batch_scaled: true,
        alive: Vec::new(),
        recomputed: Vec::new(),
        state_made: 0,
    };
    at.windows = vec![
        window("forward", 1200),
        window("backward", 1300),
        window("recompute d", 1250),
        window("recompute c", 1200),
        window("recompute b", 1150),
        window("recompute a", 1100),
        window("step", 1050),
    ];
    let inputs = [40, 10, 30, 20];
    let none = [false; 4];
    assert_eq!(floor_offloaded(&at, &inputs, &none), 1300);
    // All offloaded: the forward without all but the last two (1200 - 50), backward
    // without all four (1200); recomputing d, a is still away (b comes back before:
    // 1250 - 40), recomputing c, nothing (1200).
    let all = [true; 4];
    assert_eq!(floor_offloaded(&at, &inputs, &all), 1210);
    // To fit 1260: a (the largest input) is enough: 1300 - 40.
    let (chosen, peak) = choose_offloaded(&at, &inputs, 1260).unwrap();
    assert_eq!(chosen, [true, false, false, false]);
    assert_eq!(peak, 1260);
    // To fit 1230: a, then c: the backward at 1230, the recomputation of d at 1210.
    let (chosen, peak) = choose_offloaded(&at, &inputs, 1230).unwrap();
    assert_eq!(chosen, [true, false, true, false]);
    assert_eq!(peak, 1230);
    // Below what every input in host memory gives: none.
    assert!(choose_offloaded(&at, &inputs, 1209).is_none());
}

#[test]
fn a_profile_scales_what_grows_with_the_input_and_keeps_the_rest() {
    let at = scaled(&profile(), 0.5);
    assert_eq!(
        at.windows[0].peak, 1025,
        "the resident 1000 kept, the 50 above halved"
    );
    assert_eq!(at.windows[0].alive, vec![(0, 50), (1, 50)]);
    assert_eq!(at.segments[0].kept_bytes, 50);
    assert_eq!(at.segments[0].recompute_seconds, 0.5);
    assert_eq!(at.step_seconds, 5.0);
    assert_eq!(at.unplanned_peak(), 1125);
}

#[test]
fn a_static_plan_for_the_largest_input_recomputes_at_every_size_and_dynamic_does_not() {
    let largest = profile();
    // Unplanned at the largest: 1250; with one checkpointed: 1150; both: 1050.
    assert_eq!(largest.unplanned_peak(), 1250);
    let budget = 1150;
    // Half the draws at the largest, half at a quarter of it (unplanned 1062: all kept).
    let ratios = [1.0, 0.25, 1.0, 0.25];
    let compared = compare_multiscale(&largest, None, &ratios, budget);
    let fixed = compared.static_plan.unwrap();
    assert_eq!(compared.static_checkpointed, (1, 2));
    // The static plan recomputes one segment at every size (10 - 1 s at the largest, 2.5 -
    // 0.25 at a quarter); dynamic only at the largest (a quarter: 2.5 - 0.5, nothing
    // recomputed).
    assert!(
        (fixed.mean_seconds - (9.0 + 2.25) / 2.0).abs() < 1e-9,
        "{fixed:?}"
    );
    assert!(
        (compared.dynamic.mean_seconds - (9.0 + 2.0) / 2.0).abs() < 1e-9,
        "{compared:?}"
    );
    assert!(compared.dynamic.mean_seconds < fixed.mean_seconds);
    assert!(compared.dynamic.max_peak <= budget && fixed.max_peak <= budget);
    assert!(compared.all_checkpointed.mean_seconds > fixed.mean_seconds);
    // Below the least at the largest: no static plan.
    let tight = compare_multiscale(&largest, None, &ratios, 1000);
    assert_eq!(tight.static_plan, None);
}
