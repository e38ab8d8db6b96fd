//! The phases of a training step: the tags the runner and the optimizer hook open around them,
//! so that the bytes live at a peak can be told apart by what allocated them (see
//! [`super::scope`]), and the moment each phase ends, for whoever measures the step (the
//! planner's profile) without the loop knowing it is measured.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

/// The model's forward and loss (`Runner`): what is still live of it is what backward keeps.
pub const FORWARD: &str = "forward";
/// The backward pass (the optimizer hook): gradients, of parameters and in flight.
pub const BACKWARD: &str = "backward";
/// A checkpointed segment's forward run again in backward: its activations, briefly.
pub const RECOMPUTE: &str = "recompute";
/// Clipping and the optimizer step: the new weights and the optimizer's state.
pub const STEP: &str = "step";
/// The half-precision copy of the weights the forward runs on (mixed precision).
pub const HALF_WEIGHTS: &str = "half_weights";

/// Told the name of each phase run by [`in_phase`] as it ends.
pub type PhaseListener = Box<dyn Fn(&'static str) + Send + Sync>;

static LISTENING: AtomicBool = AtomicBool::new(false);
static LISTENER: RwLock<Option<PhaseListener>> = RwLock::new(None);

/// Runs `f` as the phase `name` of a step: under the tag `name` (see [`super::scope`]), then
/// tells the listener, if one is set, that the phase ended. Returns what `f` returns.
pub fn in_phase<R>(name: &'static str, f: impl FnOnce() -> R) -> R {
    let out = super::scope(name, f);
    if LISTENING.load(Ordering::Acquire) {
        let listener = LISTENER
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(listener) = &*listener {
            listener(name);
        }
    }
    out
}

/// Sets the one listener of phase ends (`None` removes it); returns the one it replaces.
pub fn on_phase_end(listener: Option<PhaseListener>) -> Option<PhaseListener> {
    let mut slot = LISTENER
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    LISTENING.store(listener.is_some(), Ordering::Release);
    std::mem::replace(&mut *slot, listener)
}
