//! memsave-models' tests (Burn 0.21), in one binary: one build and one link for what they all
//! use, where a binary per file built and linked them four times. Each file below is a module of
//! the tests of one part; `cargo test -p memsave-models --test suite detection::` runs one.

mod detection;
mod resnet;
mod voc;
mod weights;
