//! Which module types a `#[with_cp]` method ran for, and the check that every module switched on
//! has one: a block whose `with_cp` flag is on but whose forward is not marked `#[with_cp]`
//! would otherwise train without checkpointing, silently.
//!
//! The check cannot be made when the code compiles: `#[memsave::model]` on the struct and
//! `#[with_cp]` on a method are expanded apart, and a method's attribute can add nothing outside
//! its `impl` block that names the type (a trait `impl` takes no extra item). So the first step
//! makes it: [`crate::train::Runner`] ends with an error, burn-train's adapter warns, and
//! `memsave::check` names the cause (through [`crate::check::switched_on_without_segment`]).

use std::sync::Mutex;

use super::id::SegmentId;

/// The types `checkpoint_with` ran for in this process, whether or not it checkpointed (MMCV's
/// guard). It only grows: a run in another thread can only add to it.
static REACHED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// Notes that a `#[with_cp]` method of `id`'s type ran.
pub(crate) fn note(id: SegmentId) {
    let mut reached = REACHED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !reached.contains(&id.type_name) {
        reached.push(id.type_name);
    }
}

/// Whether a `#[with_cp]` method of `id`'s type has run in this process.
pub fn reached(id: SegmentId) -> bool {
    REACHED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .contains(&id.type_name)
}

/// The types whose `with_cp` flag is on, as `visit` reports each module's flag, and for which no
/// `#[with_cp]` method has run: call it after a forward pass. Each is named once, short
/// (`Block`). [`crate::check::switched_on_without_segment`] asks it of a model.
pub fn unreached(visit: impl FnOnce(&mut dyn FnMut(SegmentId, bool))) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    visit(&mut |id, on| {
        let name = id.type_name();
        if on && !reached(id) && !found.contains(&name) {
            found.push(name);
        }
    });
    found
}

/// The error (or warning) for [`unreached`]'s types.
pub fn no_segment_message(types: &[String]) -> String {
    let list = types
        .iter()
        .map(|name| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "checkpointing is switched on in {list}, but no `#[with_cp]` method of {} ran in the \
         first step, so nothing was checkpointed: mark the method that computes the block \
         (its forward) `#[with_cp]`, as in `#[with_cp] fn forward(&self, x: Tensor<B, 4>) -> \
         Tensor<B, 4>`, or switch its `with_cp` off",
        if types.len() == 1 { "it" } else { "them" }
    )
}
