//! The phases of a training step: the tags the runner and the optimizer hook open around them,
//! so that the bytes live at a peak can be told apart by what allocated them (see
//! [`super::scope`]), and the moment each phase ends, for whoever measures the step (the
//! planner's profile) without the loop knowing it is measured.

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

/// The run's listener ([`crate::run::RunContext::part`]).
#[derive(Default)]
struct Listener(RwLock<Option<PhaseListener>>);

/// Runs `f` as the phase `name` of a step: under the tag `name` (see [`super::scope`]), then
/// tells the current run's listener, if one is set, that the phase ended. Returns what `f`
/// returns.
pub fn in_phase<R>(name: &'static str, f: impl FnOnce() -> R) -> R {
    let out = super::scope(name, f);
    let listener = crate::run::current().part::<Listener>();
    let listener = listener
        .0
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(listener) = &*listener {
        listener(name);
    }
    out
}

/// Sets the current run's one listener of phase ends (`None` removes it); returns the one it
/// replaces.
pub fn on_phase_end(listener: Option<PhaseListener>) -> Option<PhaseListener> {
    let part = crate::run::current().part::<Listener>();
    let mut slot = part
        .0
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    std::mem::replace(&mut *slot, listener)
}
