//! A measured profile predicted for another setting: its batch, accumulation, optimizer,
//! passes and 8-bit state.

use super::setting::Setting;
use crate::planner::Profile;

/// Bytes one byte of fp32 optimizer state takes in 8 bits (a byte a value, a scale per block).
pub const INT8_STATE_SHARE: f64 = (1.0 + 4.0 / crate::quant::BLOCK as f64) / 4.0;

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
    // Under optimizer offload the state is in host memory: the optimizer changes no device
    // byte.
    let optimizer_copy = if from.adam && !to.adam && !from.offload_optimizer {
        profile.trainable
    } else {
        0
    };
    // Accumulation's fp32 sums, on the device unless optimizer offload keeps them on the host.
    let accumulates = to.cumulative > 1 && from.cumulative == 1 && !to.offload_optimizer;
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
    // Activation offload copies each micro-batch's segment inputs: they grow with it.
    out.offloaded_bytes = (profile.offloaded_bytes as f64 * factor) as u64;
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
        // Under optimizer offload the state is in host memory: its time changes, no device byte.
        let saved = if from.offload_optimizer {
            0
        } else {
            (state * (1.0 - INT8_STATE_SHARE)) as u64
        };
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
