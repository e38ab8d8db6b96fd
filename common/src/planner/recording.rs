//! One step recorded as the planner's [`Profile`]: the recorder started with a meter, the
//! segments named by their paths in the model whose forward runs the step, and the events turned
//! into the profile at its end. Burn-free: each runtime tells it the model's segments and
//! trainable parameters (memsave's `ProfileHook` and `DynamicHook` on Burn 0.21,
//! `memsave_next::planner` on Burn 0.22).

use std::collections::HashMap;
use std::sync::Arc;

use super::{GradientEstimate, Profile};
use crate::checkpoint::profile::{self as recorder, Boundary};
use crate::checkpoint::SegmentId;
use crate::memory::Meter;

/// CPU staging's counts now, as the runtime reads them: activation offload's bytes copied to
/// the host, and the host's optimizer-step seconds (both 0 where it does not stage).
pub type Staged = Arc<dyn Fn() -> (u64, f64) + Send + Sync>;

/// No CPU staging: counts that stay 0.
pub fn no_staging() -> Staged {
    Arc::new(|| (0, 0.0))
}

/// A step being recorded (see the [module docs](self)).
pub struct Recording {
    ids: HashMap<SegmentId, String>,
    /// The seconds of the step's first pass, when it runs two.
    first_pass: Option<f64>,
    staged: Staged,
    /// CPU staging's counts as the recorded pass began.
    staged_at_start: (u64, f64),
}

impl Recording {
    /// Starts recording on the calling training thread with `meter`; `ids`: the segments of the
    /// model whose forward runs the step, to their paths.
    pub fn begin(meter: Box<dyn Meter>, ids: HashMap<SegmentId, String>, staged: Staged) -> Self {
        let staged_at_start = staged();
        recorder::start(meter);
        recorder::boundary(Boundary::Start);
        Recording {
            ids,
            first_pass: None,
            staged,
            staged_at_start,
        }
    }

    /// Goes on recording afresh (a retry of the step), the meter kept.
    pub fn again(ids: HashMap<SegmentId, String>, staged: Staged) -> Self {
        let staged_at_start = staged();
        recorder::restart();
        Recording {
            ids,
            first_pass: None,
            staged,
            staged_at_start,
        }
    }

    /// The step's first pass ended (of two): the profile is of the second, which runs on the
    /// model of `ids`, and keeps the first's time.
    pub fn first_pass_done(&mut self, ids: HashMap<SegmentId, String>) {
        self.first_pass = Some(recorder::restart());
        self.ids = ids;
        // The bytes offloaded are the profiled (second) pass's.
        self.staged_at_start.0 = (self.staged)().0;
    }

    /// Ends the recording: the step's profile. `trainable`: the trainable parameters' bytes in
    /// the optimizer's unit; `layout`: the forward model's trainable parameters in visiting
    /// order (module path, gradient bytes), the gradients' estimate where the meter has no tags.
    pub fn end(self, trainable: u64, layout: Vec<(String, u64)>) -> Profile {
        recorder::boundary(Boundary::End);
        let events = recorder::stop();
        let estimate = GradientEstimate::new(layout);
        let mut profile = Profile::from_events(&events, &self.ids, trainable, &estimate);
        if let Some(seconds) = self.first_pass {
            profile.passes = 2;
            profile.first_pass_seconds = seconds;
        }
        let (bytes, host_seconds) = (self.staged)();
        profile.offloaded_bytes = bytes.saturating_sub(self.staged_at_start.0);
        profile.host_step_seconds = (host_seconds - self.staged_at_start.1).max(0.0);
        profile
    }
}
