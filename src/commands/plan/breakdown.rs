//! The figures of measured steps: the unplanned breakdown, a step's peak and median time.

use memsave::planner::Profile;
use serde::Serialize;

use crate::commands::train::Measurement;

/// The breakdown of a measured step, bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Breakdown {
    pub parameters: u64,
    /// Gradient bytes live at the peak.
    pub gradients: u64,
    /// Gradient bytes live when backward ended (all of them).
    pub gradients_at_backward_end: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub other: u64,
    pub peak: u64,
    pub step_seconds: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The median time of an optimizer step: the measured micro-batches' times summed a group at a
/// time (the measured iterations are whole groups of `cumulative`).
pub(super) fn step_seconds<'a>(
    measurements: impl IntoIterator<Item = &'a Measurement>,
    cumulative: usize,
) -> f64 {
    let groups: Vec<f64> = measurements
        .into_iter()
        .flat_map(|m| {
            m.steps
                .chunks(cumulative.max(1))
                .map(|group| group.iter().map(|s| s.0).sum::<f64>())
                .collect::<Vec<_>>()
        })
        .collect();
    median(groups)
}

pub(super) fn peak_of(measurement: &Measurement) -> u64 {
    let steps = measurement.steps.iter().map(|s| s.1).max().unwrap_or(0);
    let profiled = measurement
        .profile
        .windows
        .iter()
        .map(|w| w.peak)
        .max()
        .unwrap_or(0);
    steps.max(profiled)
}

pub(super) fn breakdown(measurement: &Measurement, cumulative: usize) -> Breakdown {
    let profile: &Profile = &measurement.profile;
    let optimizer_state =
        (measurement.trainable as f64 * measurement.optimizer_state_per_weight) as u64;
    let peak = peak_of(measurement);
    let window = profile.windows.iter().max_by_key(|w| w.peak);
    let (window_peak, gradients) = window.map_or((peak, 0), |w| (w.peak, w.gradients));
    Breakdown {
        parameters: measurement.parameters,
        gradients,
        gradients_at_backward_end: profile.gradients,
        optimizer_state,
        activations: window_peak.saturating_sub(profile.resident + gradients),
        other: profile
            .resident
            .saturating_sub(measurement.parameters + optimizer_state),
        peak,
        step_seconds: step_seconds([measurement], cumulative),
    }
}
