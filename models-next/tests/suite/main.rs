//! memsave-models-next's tests, in one binary: one build and one link for what every test uses
//! (Burn 0.22.1, memsave-next and the models), where a binary per file built and linked them
//! four times over. Each file below is a module of the tests of one model or part;
//! `cargo test -p memsave-models-next --test suite retinanet::` runs one of them.
//!
//! memsave's counting allocator is installed for all of them (the checkpointing figures read the
//! CPU's memory through it), so they take turns: every test holds `common::one_at_a_time` while
//! it runs (the watchdog takes it), and no other test allocates while one reads the allocator.

#[global_allocator]
static ALLOCATOR: memsave_next::memory::CountingAllocator = memsave_next::memory::CountingAllocator;

mod common;

mod classifier;
mod detection;
mod eval;
mod registry;
mod resnet;
mod retinanet;
mod voc;
mod weights;
