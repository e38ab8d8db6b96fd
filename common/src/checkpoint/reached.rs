//! Which module types a `#[with_cp]` method ran for in a run, and the check that every module
//! switched on has one: a block whose `with_cp` flag is on but whose forward is not marked
//! `#[with_cp]` would otherwise train without checkpointing, silently.
//!
//! The check cannot be made when the code compiles: `#[memsave::model]` on the struct and
//! `#[with_cp]` on a method are expanded apart, and a method's attribute can add nothing outside
//! its `impl` block that names the type (a trait `impl` takes no extra item). So the first step
//! makes it, with one behaviour everywhere (each runtime's `check::segments_ran`): the runner,
//! burn-train's adapter, `memsave::check` and a user's loop end with an error by default, or
//! warn where the run says so ([`set_unused_with_cp`]).

use std::sync::Mutex;

use super::{SegmentId, UnusedWithCp};
use crate::run;

/// The run's part: the types `checkpoint_with` ran for, whether or not it checkpointed (MMCV's
/// guard), and what the check does. It only grows in a run.
#[derive(Default)]
struct Reached {
    types: Mutex<Vec<&'static str>>,
    unused: Mutex<UnusedWithCp>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Notes that a `#[with_cp]` method of `id`'s type ran, in the current run.
pub fn note(id: SegmentId) {
    let reached = run::current().part::<Reached>();
    let mut types = lock(&reached.types);
    if !types.contains(&id.full_type_name()) {
        types.push(id.full_type_name());
    }
}

/// Whether a `#[with_cp]` method of `id`'s type has run in the current run.
pub fn reached(id: SegmentId) -> bool {
    lock(&run::current().part::<Reached>().types).contains(&id.full_type_name())
}

/// Sets what the current run does when a module is switched on without a `#[with_cp]` method
/// ([`UnusedWithCp`]); returns the previous choice.
pub fn set_unused_with_cp(unused: UnusedWithCp) -> UnusedWithCp {
    std::mem::replace(&mut *lock(&run::current().part::<Reached>().unused), unused)
}

/// What the current run does when a module is switched on without a `#[with_cp]` method.
pub fn unused_with_cp() -> UnusedWithCp {
    *lock(&run::current().part::<Reached>().unused)
}

/// The types whose `with_cp` flag is on, as `visit` reports each module's flag, and for which no
/// `#[with_cp]` method has run in the current run: call it after a forward pass. Each is named
/// once, short (`Block`), with the signature of one of its methods where the model knows it.
/// Each runtime's `check::switched_on_without_segment` asks it of a model.
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
