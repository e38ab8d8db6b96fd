//! Checkpointing over many training steps: live memory does not grow and no recompute thread
//! outlives its step; an input that does not require grad runs the segment plainly. The tests
//! take the binary's turn: they count the process's allocations.

use crate::common;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{PaddingConfig2d, Relu};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use common::{watchdog, Materialise, AB};
use memsave::checkpoint::{live_helpers, recomputations, set_with_cp};
use memsave::memory::current_bytes;
use memsave::nn::{BatchNorm, BatchNormConfig};
use memsave::with_cp;

/// These tests read the process's counting allocator and count its threads: one at a time.
use crate::TURN as SERIAL;

#[memsave::model]
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    conv: Conv2d<B>,
    bn: BatchNorm<B>,
    relu: Relu,
    with_cp: bool,
}

impl<B: Backend> Block<B> {
    fn new(device: &B::Device) -> Self {
        Block {
            conv: Conv2dConfig::new([3, 3], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            bn: BatchNormConfig::new(3).init(device),
            relu: Relu::new(),
            with_cp: false,
        }
    }
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.relu
            .forward(self.bn.forward(self.conv.forward(x.clone())))
            + x
    }
}

#[memsave::model]
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    stem: Conv2d<B>,
    #[with_cp]
    blocks: Vec<Block<B>>,
}

impl<B: memsave::Backend> Net<B> {
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = self.stem.forward(x);
        for block in &self.blocks {
            x = block.forward(x);
        }
        x
    }
}

#[test]
fn three_hundred_steps_do_not_grow_memory_or_threads() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (grown, per_step) = watchdog(300, || {
        let device = Default::default();
        let model = Net::<AB> {
            stem: Conv2dConfig::new([3, 3], [3, 3]).init(&device),
            blocks: (0..4).map(|_| Block::new(&device)).collect(),
        }
        .map(&mut Materialise);
        let mut model = set_with_cp(model, true);
        let mut optimizer = SgdConfig::new().init();
        let x = Tensor::<AB, 4>::random([2, 3, 8, 8], Distribution::Normal(0.0, 1.0), &device);
        let mut after = Vec::new();
        for step in 0..300 {
            let grads = model.forward(x.clone()).powf_scalar(2.0).mean().backward();
            let grads = GradientsParams::from_grads(grads, &model);
            model = optimizer.step(1e-3, model, grads);
            memsave::checkpoint::join_helpers().unwrap();
            assert_eq!(live_helpers(), 0, "a recompute thread outlived step {step}");
            after.push(current_bytes());
        }
        assert_eq!(recomputations(), 300 * 4);
        let grown = after[299] as i64 - after[49] as i64;
        (grown, after[49])
    });
    eprintln!("live bytes after step 50: {per_step}; growth from step 50 to 300: {grown} bytes");
    assert!(
        grown < 64 * 1024,
        "live memory grew by {grown} bytes over 250 checkpointed steps"
    );
}

#[test]
fn an_input_without_grad_runs_the_segment_plainly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(60, || {
        let device = Default::default();
        let mut block = Block::<AB>::new(&device).map(&mut Materialise);
        block.with_cp = true;
        let image = Tensor::<AB, 4>::random([1, 3, 4, 4], Distribution::Normal(0.0, 1.0), &device);
        let before = recomputations();
        let grads = block.forward(image).sum().backward();
        assert_eq!(recomputations(), before, "nothing to recompute");
        assert_eq!(live_helpers(), 0);
        // The parameters still train: the segment ran as written, in the graph.
        assert!(block.conv.weight.grad(&grads).is_some());
        assert!(block.bn.gamma.grad(&grads).is_some());
    });
}
