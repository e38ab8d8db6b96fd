//! memsave: GPU-memory savers for Burn training.

extern crate self as memsave;

pub use memsave_core::*;
pub use memsave_macros::{auto_fp16, force_fp32, model};
