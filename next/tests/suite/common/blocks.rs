//! A wide block (its activations 8 times its input, a dropout drawing inside) and a stack of
//! them: the model of the memory tests ("dynamic", the planner, the recorder).

use std::cell::Cell;

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::prelude::*;
use memsave_macros::{model, with_cp};

/// The block's hidden width.
pub const WIDE: usize = 512;
/// Its input and output width.
pub const NARROW: usize = 64;

thread_local! {
    static RUNS: Cell<usize> = const { Cell::new(0) };
}

/// How many times a block's forward ran on this thread since [`reset_runs`].
pub fn runs() -> usize {
    RUNS.with(Cell::get)
}

/// Counts a block's forwards from 0 again.
pub fn reset_runs() {
    RUNS.with(|runs| runs.set(0));
}

/// A wide block: its activations are 8 times its input, and a dropout draws inside it.
#[model]
#[derive(Module, Debug)]
pub struct Block {
    pub up: Linear,
    pub dropout: Dropout,
    pub down: Linear,
    pub with_cp: bool,
}

impl Block {
    #[with_cp]
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        RUNS.with(|runs| runs.set(runs.get() + 1));
        let h = burn::tensor::activation::relu(self.up.forward(x));
        self.down.forward(self.dropout.forward(h))
    }
}

/// `count` blocks, switched off, on `device` (dropout 0.25).
pub fn blocks(device: &Device, count: usize) -> Vec<Block> {
    (0..count)
        .map(|_| Block {
            up: LinearConfig::new(NARROW, WIDE).init(device),
            dropout: DropoutConfig::new(0.25).init(),
            down: LinearConfig::new(WIDE, NARROW).init(device),
            with_cp: false,
        })
        .collect()
}
