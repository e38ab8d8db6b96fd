//! memsave: GPU-memory savers for Burn training. Mixed precision with dynamic loss scaling,
//! gradient accumulation and gradient checkpointing, switched on by attribute macros on model
//! code (`#[memsave::model]`, `#[auto_fp16]`, `#[force_fp32]`, `#[with_cp]`) and one line of
//! config, with MMCV 1.x's semantics; beyond them, the optimizer's step in backward, 8-bit
//! optimizer state, a memory planner, data parallelism and ZeRO stages 1 and 2.
//!
//! # Features
//! - `cli` (default): the `memsave` command line, with the models and data parallelism. A
//!   library user leaves it out: `memsave = { .., default-features = false, features =
//!   ["burn-train"] }`, which builds nothing of the command line, the models or the
//!   distributed stack.
//! - `burn-train`: [`burn_train`], memsave's strategies in Burn's own `Learner`.
//! - `parallel`: data parallelism's transport on Burn's collective (tokio, websockets):
//!   `parallel::{BurnPeer, run_local, serve_orchestrator}`.
//! - `models`: `memsave::models`, memsave's ResNet, RetinaNet and their data.
//! - `cuda`, `wgpu`, `vulkan`, `metal`: Burn's GPU backends, with memsave's memory meter and
//!   lean kernels on them; `fusion`: Burn's kernel fusion there.

#![warn(missing_docs)]

extern crate self as memsave;

pub use memsave_core::*;
pub use memsave_macros::{auto_fp16, force_fp32, model, with_cp};

/// A backend memsave can train on: Burn's `Backend` plus gradient checkpointing. Bound generic
/// model code with it where a `#[with_cp]` method is defined or called.
pub use memsave_core::checkpoint::CheckpointBackend as Backend;

/// The models built with memsave (ResNet, an image classifier, RetinaNet) and their data
/// (feature `models`).
#[cfg(feature = "models")]
pub use memsave_models as models;
