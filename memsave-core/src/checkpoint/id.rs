//! Which module a segment runs, and its type's short name (Burn-free, shared with the port to
//! Burn 0.22: `memsave-common`).

pub use memsave_common::checkpoint::{segment_name, SegmentId};
