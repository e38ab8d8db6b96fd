//! Choices made as a segment is entered: what `with_cp = "dynamic"` hangs on
//! ([`crate::planner::DynamicHook`]).
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

/// Decides, at a segment's entry, whether it is checkpointed.
pub trait Chooser: Send {
    /// Whether the segment `id`, entered with a first float input of shape `shape`, is
    /// checkpointed (`false`: it keeps its activations for backward). `None`: as its flag says.
    fn choose(&mut self, id: SegmentId, shape: &[usize]) -> Option<bool>;
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

/// Whether the segment `id` (its flag on, its input tracked) is checkpointed: the calling
/// training thread's chooser says, where it has one and is not recomputing (a recomputation
/// repeats the forward as it ran).
pub(crate) fn choose(id: SegmentId, shape: impl FnOnce() -> Vec<usize>) -> bool {
    if !SET.with(|set| set.get()) || super::context::is_recomputing_segment() {
        return true;
    }
    let chooser = {
        let part = crate::run::current().part::<Choosers>();
        let choosers = part.0.lock().unwrap_or_else(|p| p.into_inner());
        match choosers.get(&crate::run::owner()) {
            Some(chooser) => chooser.clone(),
            None => return true,
        }
    };
    let shape = shape();
    let mut chooser = chooser.lock().unwrap_or_else(|p| p.into_inner());
    chooser.choose(id, &shape).unwrap_or(true)
}
