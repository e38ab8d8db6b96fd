//! The switches of checkpointing in a model: the `with_cp` flag a block carries
//! ([`HasWithCp`]), the modules through which it is switched on ([`CheckpointModule`], which
//! `#[memsave::model]` implements), and setting them by hand or by path. Burn-free, shared with
//! the port to Burn 0.22 (`memsave-common`); the error of [`set_with_cp_paths`] is memsave's.

pub use memsave_common::checkpoint::__private::join_path;
pub use memsave_common::checkpoint::{segment_paths, set_with_cp, CheckpointModule, HasWithCp};

/// Checkpoints exactly the segments of `model` whose paths are in `paths` (as
/// [`segment_paths`] names them), and no other: a plan pinned by hand, or the planner's.
/// A path that names no segment is an error that lists the closest ones.
pub fn set_with_cp_paths<M: CheckpointModule>(model: M, paths: &[String]) -> crate::Result<M> {
    memsave_common::checkpoint::set_with_cp_paths(model, paths)
        .map_err(|unknown| crate::Error::invalid("with_cp", unknown.detail()))
}
