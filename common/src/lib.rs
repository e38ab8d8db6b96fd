//! memsave's Burn-free parts, shared by its runtime on Burn 0.21 (`memsave-core`) and on Burn
//! 0.22.1 (`memsave-next`) while the port lasts (`docs/src/port-0.22.md`, slice 2: what names
//! nothing of Burn's moves here, so that each slice ports less). Both runtimes re-export these
//! items where they stood (`checkpoint::CheckpointModule`, ...): users never name this crate.
//!
//! - [`checkpoint`]: the switches of checkpointing in a model (the `with_cp` flags, the paths
//!   of its segments, setting them whole or by path).

#![warn(missing_docs)]

pub mod checkpoint;
