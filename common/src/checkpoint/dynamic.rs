//! Choices made as a segment is entered: what `with_cp = "dynamic"` hangs on
//! (the planner's `DynamicHook`).
//!
//! A training thread may have a [`Chooser`] in its run. Each segment whose `with_cp` flag is on
//! and whose input is tracked then asks it, at its entry, whether to checkpoint (recompute in
//! backward) or keep its activations, given the segment's identity and its input's size. A
//! segment's two ways give the same gradients, statistics and random draws (the recompute
//! segments are exact), so any mix of choices is exact too.
//!
//! Why at entry and not by eviction after the fact (DTR proper): in Burn 0.21 the tensors a
//! plain forward saves for backward are held by the autodiff graph's steps (each op's state,
//! moved into its node) until the backward consumes them; no API reaches a step's state to drop
//! it and register a recomputation in its place. A segment's choice can only be made before it
//! runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use super::SegmentId;

/// What a segment does with its activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Keeps them for backward (no recomputation).
    Keep,
    /// Keeps only its inputs, on the device, and recomputes the rest in backward.
    Recompute,
    /// Recomputes, its inputs waiting in host memory meanwhile (CPU staging: copied down in
    /// the forward, brought back before the recomputation; see activation offload).
    Offload,
}

/// Decides, at a segment's entry, what it keeps.
pub trait Chooser: Send {
    /// What the segment `id` does, entered with a first float input of shape `shape` and
    /// `bytes` of float inputs in all. `None`: as its flag says (recomputed).
    fn choose(&mut self, id: SegmentId, shape: &[usize], bytes: u64) -> Option<Choice>;
}

/// A chooser as the hook and the run share it.
pub type SharedChooser = Arc<Mutex<dyn Chooser>>;

thread_local! {
    /// Whether this thread set a chooser: segments on a thread that never did read nothing more
    /// than this (no lock of the run's parts on their path).
    static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The run's part: each training thread's chooser.
#[derive(Default)]
struct Choosers(Mutex<HashMap<ThreadId, SharedChooser>>);

/// Sets (or, with `None`, removes) the chooser of the calling training thread's steps in the
/// current run.
pub fn set_chooser(chooser: Option<SharedChooser>) {
    let part = crate::run::current().part::<Choosers>();
    let mut choosers = part.0.lock().unwrap_or_else(|p| p.into_inner());
    let owner = crate::run::owner();
    if chooser.is_some() {
        SET.with(|set| set.set(true));
    }
    match chooser {
        Some(chooser) => {
            choosers.insert(owner, chooser);
        }
        None => {
            choosers.remove(&owner);
        }
    }
}

/// What the segment `id` (its flag on, its input tracked) does: the calling training thread's
/// chooser says, where it has one; `None` where nothing chose (it is checkpointed as its flag
/// says). The runtime does not ask while it recomputes a segment (a recomputation repeats the
/// forward as it ran).
pub fn choose(id: SegmentId, input: impl FnOnce() -> (Vec<usize>, u64)) -> Option<Choice> {
    if !SET.with(|set| set.get()) {
        return None;
    }
    let chooser = {
        let part = crate::run::current().part::<Choosers>();
        let choosers = part.0.lock().unwrap_or_else(|p| p.into_inner());
        match choosers.get(&crate::run::owner()) {
            Some(chooser) => chooser.clone(),
            None => return None,
        }
    };
    let (shape, bytes) = input();
    let mut chooser = chooser.lock().unwrap_or_else(|p| p.into_inner());
    chooser.choose(id, &shape, bytes)
}
