//! memsave's runtime on Burn 0.22.1, growing slice by slice beside `memsave-core` (Burn 0.21)
//! until it replaces it: the port's plan and what each slice brought are in
//! `docs/src/port-0.22.md`. Nothing here is re-exported by `memsave` yet.
//!
//! What is here:
//! - [`backend`]: the one place that knows Burn's dispatch: a tensor's backend found from its
//!   kind, and generic code run on it (a trait impl per backend, never a type check);
//! - [`checkpoint`]: recompute-in-backward segments (`torch.utils.checkpoint`, MMCV's `with_cp`)
//!   as burn-autodiff ops, under both of Burn's checkpointing strategies;
//! - [`fp16`] and [`cast`]: mixed precision as MMCV 1.x writes it (`wrap_fp16_model`, the
//!   `fp16_enabled` flag read by `#[auto_fp16]` and `#[force_fp32]`, fp32 islands), on Burn
//!   0.22's layers;
//! - [`amp`] and [`grads`]: the step of mixed precision in a user's own loop (the loss scaled,
//!   the gradients unscaled onto fp32 masters, overflow skipped, clipping by the global norm);
//! - [`optim8`] and [`quant`]: SGD, Adam and AdamW with their state in 8 bits, as burn-optim
//!   0.22 optimizers;
//! - [`burn_train`]: mixed precision, MMCV-exact accumulation and global-norm clipping in
//!   burn-train 0.22's `Learner` (feature `burn-train`, on by default);
//! - [`memory`] and [`run`]: the counting allocator and a device's meter; one run's context
//!   (memsave-common's, shared with memsave on Burn 0.21), which the segments, the burn-train
//!   adapter and the checks record into;
//! - [`planner`]: a step's profile and the cheapest checkpoint set under a budget, in a user's
//!   own loop;
//! - [`check`]: the first step's check that every module switched on ran a `#[with_cp]` method;
//! - [`snapshot`]: a run's model, optimizer state and hooks' states in one file (burnpack
//!   records in memsave's container), resumed exactly; a 0.21 snapshot refused by name;
//! - [`weights16`]: the weights kept in 16 bits as their only copy, any optimizer stepping them
//!   in fp32 and rounding back (stochastically, to nearest, or with Kahan's compensation).

pub mod amp;
pub mod backend;
#[cfg(feature = "burn-train")]
pub mod burn_train;
pub mod cast;
pub mod check;
pub mod checkpoint;
pub mod config;
pub mod fp16;
pub mod frozen;
pub mod grads;
pub mod hooks;
pub mod memory;
pub mod nn;
pub mod offload;
pub mod optim8;
/// Data parallelism on Burn 0.22: so far which samples each peer reads ([`parallel::Shard`],
/// PyTorch's `DistributedSampler`), which the data sets take; the peers and the collective come
/// with the port's slice 7 (`docs/src/port-0.22.md`).
pub mod parallel {
    pub use memsave_common::parallel::Shard;
}
pub mod planner;
pub mod quant;
pub mod snapshot;
pub mod train;
pub mod weights16;

pub use memsave_common::error::{Error, Result};
pub use memsave_common::run;
pub use memsave_common::run::RunContext;
pub use memsave_common::scaler;
