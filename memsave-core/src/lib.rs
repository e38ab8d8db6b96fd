//! Runtime of memsave: the code that the attribute macros of `memsave-macros` call into, and the
//! training strategies they switch on.
//!
//! - [`cast`]: recursive fp32 <-> half casting over tensors and containers (MMCV's
//!   `cast_tensor_type`).
//! - [`fp16`]: the `fp16_enabled` flag, [`fp16::Fp16Module`] and [`fp16::wrap_fp16_model`].
//! - [`checkpoint`]: recompute-in-backward segments (MMCV's `with_cp`).
//! - [`memory`]: peak live bytes on the CPU (a counting global allocator).
//! - [`nn`]: normalisation layers that stay in fp32 inside a half-precision model.

pub mod cast;
pub mod checkpoint;
pub mod config;
mod error;
pub mod fp16;
pub mod hooks;
pub mod memory;
pub mod nn;
pub mod scaler;
pub mod train;

pub use error::{Error, Result};
