//! memsave's tests (Burn 0.21), in one binary: one build and one link for what they all use
//! (Burn, memsave, its models and command line), where a binary per file built and linked them
//! over twenty times. Each file below is a module of the tests of one capability; `cargo test
//! --test suite zero::` runs one of them.
//!
//! No counting allocator here and the tests run side by side: the tests that read the process's
//! memory, or seed Flex's one random generator and compare what it draws, are in `tests/metered/`,
//! where they take turns. The device suite (`tests/device.rs`) is a binary of its own: CI builds
//! it with the `vulkan` feature.

#[path = "../common/mod.rs"]
mod common;

mod bench;
mod burn_layers;
mod burn_train;
mod cast;
mod checkpoint;
mod checkpoint_edges;
mod checkpoint_inputs;
mod cli;
mod config;
mod detector;
mod distributed;
mod distributed_cli;
mod fp16_table;
mod fp32_island;
mod norm;
mod ops;
mod plan_cli;
mod run_context;
mod runner;
mod scaler;
mod weights;
mod with_cp_trap;
mod wrap_fp16;
mod zero;
