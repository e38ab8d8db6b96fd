//! Runtime of memsave: the code that the attribute macros of `memsave-macros` call into, and the
//! training strategies they switch on.
//!
//! - [`cast`]: recursive fp32 <-> half casting over tensors and containers (MMCV's
//!   `cast_tensor_type`).
//! - [`fp16`]: the `fp16_enabled` flag, [`fp16::Fp16Module`] and [`fp16::wrap_fp16_model`].
//! - [`checkpoint`]: recompute-in-backward segments (MMCV's `with_cp`).
//! - [`memory`]: peak live bytes on the CPU (a counting global allocator), live bytes by the
//!   code that allocated them, the memory available.
//! - [`nn`]: layers and operations that keep only what backward needs (norms, ReLU, the
//!   convolution's weight gradient), norms that stay fp32 inside a half-precision model, and
//!   dropout replayed under checkpointing.
//! - [`planner`]: the memory planner (which segments to checkpoint for a budget) and the
//!   advice on what fits.
//! - [`scaler`], [`hooks`], [`train`], [`config`]: loss scaling, MMCV's runner and hooks,
//!   snapshots, and the TOML configuration.
//! - [`parallel`]: data parallelism on Burn's collective (MMCV's `mmcv.parallel`): the
//!   optimizer hook's reducer part, the weight broadcast, the sampler's shards, the peers.
//! - [`run`]: one run's state in a context the run owns ([`RunContext`]): its settings,
//!   figures and failures; two runs in one process each see their own.

#![warn(missing_docs)]

#[cfg(feature = "burn-train")]
pub mod burn_train;
pub mod cast;
pub mod check;
pub mod checkpoint;
pub mod config;
mod error;
pub mod fp16;
pub mod hooks;
pub mod memory;
pub mod nn;
pub mod parallel;
pub mod planner;
pub mod run;
/// The loss scaler of mixed precision (memsave-common's: it names nothing of Burn's).
pub use memsave_common::scaler;
pub mod train;

pub use error::{panic_text, Error, Result};
pub use run::RunContext;
