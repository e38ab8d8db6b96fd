//! Which module types a `#[with_cp]` method ran for, and the check that every module switched
//! on has one: a block whose `with_cp` flag is on but whose forward is not marked `#[with_cp]`
//! would otherwise train without checkpointing, silently (the check cannot be made when the code
//! compiles: the struct's and the method's attributes are expanded apart).
//!
//! On Burn 0.21 the record is the run's (its context); on 0.22 it is the process's until the
//! run's context is ported (slice 5): a type noted once stays noted.

use std::sync::Mutex;

use super::SegmentId;

static REACHED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

fn types() -> std::sync::MutexGuard<'static, Vec<&'static str>> {
    REACHED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Notes that a `#[with_cp]` method of `M` ran (checkpointed or not: MMCV's guard counts).
pub(crate) fn note<M>() {
    let name = std::any::type_name::<M>();
    let mut types = types();
    if !types.contains(&name) {
        types.push(name);
    }
}

/// Whether a `#[with_cp]` method of `id`'s type has run.
pub fn reached(id: SegmentId) -> bool {
    types().contains(&id.full_type_name())
}

/// The types whose `with_cp` flag is on, as `visit` reports each module's flag, and for which no
/// `#[with_cp]` method has run: call it after a forward pass. Each is named once, short.
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
