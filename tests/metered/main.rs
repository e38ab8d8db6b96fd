//! memsave's tests (Burn 0.21) that read the process's memory or Flex's one random generator, in
//! one binary: memsave's counting allocator is installed, and every test holds [`TURN`] while it
//! runs, so that no other test allocates while one measures, nor draws between a seed and what
//! a test compares. `cargo test --test metered dynamic::` runs one file's tests.

#[global_allocator]
static ALLOCATOR: memsave::memory::CountingAllocator = memsave::memory::CountingAllocator;

/// The turn every test of this binary holds while it runs.
pub static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[path = "../common/mod.rs"]
mod common;

mod backends;
mod check;
mod checkpoint_dropout;
mod checkpoint_random;
mod checkpoint_steps;
mod dynamic;
mod eight_bit;
mod memory;
mod memory_ops;
mod planner;
mod planner_feedback;
mod step_in_backward;
