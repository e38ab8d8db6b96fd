//! Layers that memsave models need beyond `burn::nn`.
//!
//! [`BatchNorm`] and [`GroupNorm`] stay in fp32 inside a half-precision model, as MMCV's
//! `wrap_fp16_model` keeps them: with the flag on, the input is cast to fp32, normalised with
//! fp32 weights and statistics, and the output is cast back to half. [`BatchNorm`] and
//! [`Dropout`] also behave under gradient checkpointing: statistics updated once per step,
//! masks reused by the recomputation.

mod batch_norm;
mod dropout;
mod group_norm;

pub use batch_norm::{BatchNorm, BatchNormConfig};
pub use dropout::{Dropout, DropoutConfig};
pub use group_norm::{GroupNorm, GroupNormConfig};
