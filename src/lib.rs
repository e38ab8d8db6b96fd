//! memsave: GPU-memory savers for Burn training.

extern crate self as memsave;

pub use memsave_core::*;
pub use memsave_macros::{auto_fp16, force_fp32, model, with_cp};

/// A backend memsave can train on: Burn's `Backend` plus gradient checkpointing. Bound generic
/// model code with it where a `#[with_cp]` method is defined or called.
pub use memsave_core::checkpoint::CheckpointBackend as Backend;

/// The models built with memsave (ResNet, an image classifier) and their data.
pub use memsave_models as models;
