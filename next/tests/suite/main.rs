//! memsave-next's tests, in one binary: one build and one link for what every test uses (Burn
//! 0.22.1 and memsave-next), where a binary per file built and linked them twenty times over.
//! Each file below is a module of the tests of one capability; `cargo test -p memsave-next
//! --test suite in_backward::` runs one of them.
//!
//! memsave's counting allocator is installed for all of them (the planner, `"dynamic"` and the
//! figures read the CPU's memory through it), so they take turns: every test holds
//! `common::one_at_a_time` while it runs (the watchdog takes it), and no other test allocates
//! while one reads the allocator. `tests/checkpoint_memory.rs` stays a binary of its own: it
//! counts with an allocator of its own and checks the errors where memsave's is not installed.

#[global_allocator]
static ALLOCATOR: memsave_next::memory::CountingAllocator = memsave_next::memory::CountingAllocator;

mod common;

mod amp;
mod burn_train;
mod cast;
mod checkpoint;
mod checkpoint_edges;
mod checkpoint_layers;
mod config;
mod fp16;
mod fp16_layers;
mod fp32_island;
mod frozen;
mod in_backward;
mod learner_dynamic;
mod model;
mod nn;
mod offload;
mod optim8;
mod run;
mod runner;
mod runner_dynamic;
mod snapshot;
mod weights16;
