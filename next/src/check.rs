//! The check of a model's checkpointing switches after its first step: every module switched on
//! ran a `#[with_cp]` method (else it trained without checkpointing, and the memory the switch
//! was meant to save was spent). memsave's burn-train adapter makes it; a user's own loop calls
//! [`segments_ran`] after its first backward.

use crate::checkpoint::{no_segment_message, unreached, UnusedWithCp};
use crate::fp16::Fp16Module;
use crate::{Error, Result};

/// The types of `model` whose `with_cp` switch is on and for which no `#[with_cp]` method has
/// run, each named once, short (`Block`).
pub fn switched_on_without_segment<M: Fp16Module>(model: &M) -> Vec<String> {
    unreached(|visit| model.visit_with_cp_flags(visit))
}

/// After a step's forward: every module of `model` whose `with_cp` switch is on ran a
/// `#[with_cp]` method. Where one did not, `unused` says what happens: an error naming the
/// types (the default, [`UnusedWithCp::Error`]), or the warning's text (an event with target
/// `memsave` is the caller's to emit).
pub fn segments_ran<M: Fp16Module>(model: &M, unused: UnusedWithCp) -> Result<Option<String>> {
    let missing = switched_on_without_segment(model);
    if missing.is_empty() {
        return Ok(None);
    }
    let message = no_segment_message(&missing);
    match unused {
        UnusedWithCp::Error => Err(Error::invalid("with_cp", message)),
        UnusedWithCp::Warn => Ok(Some(message)),
    }
}
