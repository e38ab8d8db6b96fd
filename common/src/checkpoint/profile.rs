//! What the planner measures of a training step: per segment, the bytes its forward leaves live
//! and its time; per recomputation in backward, the bytes it makes live and its time; and, at
//! the boundaries of the step's phases, the live bytes and the highest live bytes since the
//! previous boundary. Off unless [`start`] was called: then each segment and recomputation costs
//! two reads of the live bytes and a device sync.
//!
//! One recording at a time per training thread of a run: the recorders are the run's
//! ([`crate::run`]), one per training thread (data-parallel peers in one process record each
//! their own), read by that thread and the helpers it starts. (On the CPU the bytes an
//! [`crate::memory::AllocatorMeter`] reads are the process's: two runs measured at once read
//! each other's bytes; a peer's [`crate::memory::SlotMeter`] reads its own.)
//!
//! The events are read by the planner's `Profile::from_events`. Bytes come from the one
//! [`Meter`]: the counting allocator on the CPU, the device's pools elsewhere.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Instant;

use super::SegmentId;
use crate::memory::Meter;

/// A boundary between phases of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Boundary {
    /// The step starts (before its forward).
    Start,
    /// The forward and the loss are done; backward starts.
    ForwardEnd,
    /// Backward is done; the optimizer step starts.
    BackwardEnd,
    /// The step is done.
    End,
}

/// One measurement.
#[derive(Clone, Debug)]
pub enum Event {
    /// A segment's forward ran (checkpointed or not).
    Forward {
        /// Its module.
        id: SegmentId,
        /// Live bytes before and after it.
        before: u64,
        /// See `before`.
        after: u64,
        /// Its time.
        seconds: f64,
        /// Whether it was checkpointed (kept only its input).
        checkpointed: bool,
    },
    /// A checkpointed segment was recomputed in backward. Starts a window.
    Recompute {
        /// Its module.
        id: SegmentId,
        /// The most live bytes since the previous window started.
        window_peak: u64,
        /// Live bytes before and after the recomputed forward.
        before: u64,
        /// See `before`.
        after: u64,
        /// Gradient bytes live when it started.
        gradients: Option<u64>,
        /// The recomputed forward's time.
        seconds: f64,
    },
    /// A recomputation's helper sent its last gradient: what it still holds (its inputs and
    /// graph, scratch memory) stays live until the outer backward ends.
    Released {
        /// Its module.
        id: SegmentId,
        /// Bytes it holds beyond the gradients it sent.
        held: u64,
    },
    /// The recomputations' helper threads were joined at the end of backward: what they held
    /// until then (on the CPU, each thread's matrix-product scratch) was freed.
    Joined {
        /// How many.
        helpers: usize,
        /// Live bytes before and after.
        before: u64,
        /// See `before`.
        after: u64,
    },
    /// A phase boundary. Starts a window.
    Boundary {
        /// Which.
        at: Boundary,
        /// The most live bytes since the previous window started.
        window_peak: u64,
        /// Live bytes now.
        live: u64,
        /// Gradient bytes live now.
        gradients: Option<u64>,
        /// Seconds since [`start`].
        seconds: f64,
    },
}

struct Recorder {
    probe: Box<dyn Meter>,
    events: Vec<Event>,
    started: Instant,
}

/// The run's part: how many recordings are on, and each training thread's recorder.
#[derive(Default)]
struct Profiling {
    active: AtomicUsize,
    recorders: Mutex<HashMap<ThreadId, Recorder>>,
}

/// The calling training thread's recorder, if it records.
struct Mine<'a>(
    std::sync::MutexGuard<'a, HashMap<ThreadId, Recorder>>,
    ThreadId,
);

impl Mine<'_> {
    fn as_ref(&self) -> Option<&Recorder> {
        self.0.get(&self.1)
    }

    fn as_mut(&mut self) -> Option<&mut Recorder> {
        self.0.get_mut(&self.1)
    }
}

fn profiling() -> Arc<Profiling> {
    crate::run::current().part::<Profiling>()
}

thread_local! {
    /// The segment whose `checkpoint_segment` runs on this thread now.
    static PENDING: Cell<Option<SegmentId>> = const { Cell::new(None) };
}

fn recorders(profiling: &Profiling) -> std::sync::MutexGuard<'_, HashMap<ThreadId, Recorder>> {
    profiling
        .recorders
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn recorder(profiling: &Profiling) -> Mine<'_> {
    Mine(recorders(profiling), crate::run::owner())
}

/// Starts recording, with `probe` reading the memory; drops what an earlier recording left.
pub fn start(probe: Box<dyn Meter>) {
    probe.window_peak();
    let profiling = profiling();
    let mut recorders = recorders(&profiling);
    let earlier = recorders.insert(
        crate::run::owner(),
        Recorder {
            probe,
            events: Vec::new(),
            started: Instant::now(),
        },
    );
    profiling.active.store(recorders.len(), Ordering::SeqCst);
    drop(recorders);
    if earlier.is_some() {
        return;
    }
    // The step's phases mark their own ends (`memory::in_phase`): the loop knows nothing of
    // the recording.
    crate::memory::on_phase_end(Some(Box::new(|phase| match phase {
        crate::memory::phase::FORWARD => boundary(Boundary::ForwardEnd),
        crate::memory::phase::BACKWARD => boundary(Boundary::BackwardEnd),
        _ => {}
    })));
}

/// Starts the recording afresh, the meter kept: the events so far are dropped and a new
/// [`Boundary::Start`] is marked. Returns the seconds recorded before (a step's first pass,
/// when it runs two).
pub fn restart() -> f64 {
    if !is_recording() {
        return 0.0;
    }
    let profiling = profiling();
    let seconds = match recorder(&profiling).as_mut() {
        Some(recorder) => {
            let seconds = recorder.started.elapsed().as_secs_f64();
            recorder.events.clear();
            recorder.started = Instant::now();
            recorder.probe.window_peak();
            seconds
        }
        None => 0.0,
    };
    boundary(Boundary::Start);
    seconds
}

/// Stops recording; returns the events.
pub fn stop() -> Vec<Event> {
    let profiling = profiling();
    let mut recorders = recorders(&profiling);
    let events = recorders.remove(&crate::run::owner()).map(|r| r.events);
    profiling.active.store(recorders.len(), Ordering::SeqCst);
    if recorders.is_empty() {
        crate::memory::on_phase_end(None);
    }
    events.unwrap_or_default()
}

/// Whether the calling training thread records, in the current run.
pub fn is_recording() -> bool {
    let profiling = profiling();
    profiling.active.load(Ordering::Relaxed) > 0 && recorder(&profiling).as_ref().is_some()
}

/// Marks a phase boundary (the step's start and end: the profiling hook; the ends of forward
/// and backward: their phases, through [`crate::memory::on_phase_end`]); nothing unless
/// recording.
pub fn boundary(at: Boundary) {
    if !is_recording() {
        return;
    }
    if let Some(recorder) = recorder(&profiling()).as_mut() {
        let window_peak = recorder.probe.window_peak();
        let event = Event::Boundary {
            at,
            window_peak,
            live: recorder.probe.live(),
            gradients: recorder.probe.gradients(),
            seconds: recorder.started.elapsed().as_secs_f64(),
        };
        recorder.events.push(event);
    }
}

fn live() -> u64 {
    recorder(&profiling())
        .as_ref()
        .map_or(0, |r| r.probe.live())
}

/// Runs a segment's forward `f`, recording it when a recording is on; `sync` waits for the
/// device. While `f` runs, [`pending`] names the segment (for its recomputation).
pub fn forward<O>(id: SegmentId, checkpointed: bool, sync: impl Fn(), f: impl FnOnce() -> O) -> O {
    let previous = PENDING.with(|p| p.replace(Some(id)));
    struct Restore(Option<SegmentId>);
    impl Drop for Restore {
        fn drop(&mut self) {
            PENDING.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(previous);
    if !is_recording() {
        return f();
    }
    sync();
    let before = live();
    let started = Instant::now();
    let out = f();
    sync();
    let seconds = started.elapsed().as_secs_f64();
    let after = live();
    if let Some(recorder) = recorder(&profiling()).as_mut() {
        recorder.events.push(Event::Forward {
            id,
            before,
            after,
            seconds,
            checkpointed,
        });
    }
    out
}

/// The segment whose forward runs on this thread now, if any.
pub fn pending() -> Option<SegmentId> {
    PENDING.with(Cell::get)
}

/// Runs a recomputation `f` of the segment `id`, recording it when a recording is on.
pub fn recompute<O>(id: Option<SegmentId>, sync: impl Fn(), f: impl FnOnce() -> O) -> O {
    let Some(id) = id.filter(|_| is_recording()) else {
        return f();
    };
    sync();
    let (window_peak, before, gradients) = match recorder(&profiling()).as_ref() {
        Some(r) => (r.probe.window_peak(), r.probe.live(), r.probe.gradients()),
        None => return f(),
    };
    let started = Instant::now();
    let out = f();
    sync();
    let seconds = started.elapsed().as_secs_f64();
    let after = live();
    if let Some(recorder) = recorder(&profiling()).as_mut() {
        recorder.events.push(Event::Recompute {
            id,
            window_peak,
            before,
            after,
            gradients,
            seconds,
        });
    }
    out
}

/// Runs `join` (joining `helpers` helper threads), recording what it freed.
pub fn joined(helpers: usize, join: impl FnOnce()) {
    if !is_recording() || helpers == 0 {
        return join();
    }
    let before = live();
    join();
    let after = live();
    if let Some(recorder) = recorder(&profiling()).as_mut() {
        recorder.events.push(Event::Joined {
            helpers,
            before,
            after,
        });
    }
}

/// Live bytes now, when a recording is on.
pub fn live_if_recording() -> Option<u64> {
    is_recording().then(live)
}

/// Records what the recomputation of `id`, started at `started` live bytes, holds now beside
/// the `sent` bytes of gradients it handed over.
pub fn released(id: SegmentId, started: u64, sent: u64) {
    let held = live().saturating_sub(started).saturating_sub(sent);
    if let Some(recorder) = recorder(&profiling()).as_mut() {
        recorder.events.push(Event::Released { id, held });
    }
}
