//! memsave's Burn-free parts, shared by its runtime on Burn 0.21 (`memsave-core`) and on Burn
//! 0.22.1 (`memsave-next`) while the port lasts (`docs/src/port-0.22.md`, slice 2: what names
//! nothing of Burn's moves here, so that each slice ports less). Both runtimes re-export these
//! items where they stood (`checkpoint::CheckpointModule`, ...): users never name this crate.
//!
//! - [`checkpoint`]: the switches of checkpointing in a model (the `with_cp` flags, the paths
//!   of its segments, setting them whole or by path);
//! - [`config`]: the TOML configuration with MMCV's section names, its checks and its
//!   Burn-free parts of a run (each runtime makes its hooks from it);
//! - [`error`]: memsave's [`Error`], every error a user can meet, named by field, file, peer or
//!   device;
//! - [`fp16`]: the half-precision types of mixed precision;
//! - [`groups`]: gradient accumulation's groups and MMCV's loss factor;
//! - [`scaler`]: the loss scaler of mixed precision (MMCV's `LossScaler`);
//! - [`clip`]: clipping by the global norm, as configured (PyTorch's `clip_grad_norm_`);
//! - [`snapshot`]: the snapshot format's version and errors;
//! - [`quant`]: the numbers of the 8-bit optimizer state (its block, its dynamic map);
//! - [`draws`]: counter-based uniform draws (the stochastic rounding of 16-bit weights);
//! - [`memory`]: the counting allocator, its tags and timeline, and the [`memory::Meter`] trait;
//! - [`offload`]: CPU staging's settings;
//! - [`optim`]: which optimizer, as a config writes it (MMCV's names), and how it keeps its state;
//! - [`parallel`]: what ZeRO shards, and which peer owns each parameter;
//! - [`planner`]: a step's measured profile, the cheapest checkpoint set under a budget, the
//!   advice when none fits;
//! - [`weights`]: what the trainable weights are kept in;
//! - [`run`]: one run's context ([`run::RunContext`]): what a run switches and counts;
//! - [`train`]: the runner's Burn-free parts: the run's length, the hooks' order, the log line,
//!   the learning-rate schedule and when snapshots are written.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod clip;
pub mod config;
pub mod draws;
pub mod error;
pub mod fp16;
pub mod groups;
pub mod memory;
pub mod offload;
pub mod optim;
pub mod parallel;
pub mod planner;
pub mod quant;
pub mod run;
pub mod scaler;
pub mod snapshot;
pub mod train;
pub mod weights;

pub use error::{panic_text, Error, Result};

/// `bytes` in the largest binary unit that keeps the number at or above 1 (`894.1 GiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
