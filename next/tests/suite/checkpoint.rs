//! Checkpointed segments on Burn 0.22.1 (Flex): the gradients of every parameter and input equal
//! the plain run's bit for bit under both of Burn's checkpointing strategies, "no gradient"
//! stays none where plain Burn gives none, the segment is recomputed in backward, and MMCV's
//! guard runs a segment without a tracked input as written.

use std::cell::Cell;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Int;
use memsave_next::checkpoint::checkpoint;

use crate::common;
use common::{bits, devices, grad_bits, watchdog};

thread_local! {
    /// The segment runs on this thread (the recomputation runs on the thread of the backward).
    static RUNS: Cell<usize> = const { Cell::new(0) };
}

fn runs() -> usize {
    RUNS.with(Cell::get)
}

/// A block: two layers, and one it never uses (which must get no gradient).
#[derive(Module, Debug)]
struct Block {
    fc1: Linear,
    fc2: Linear,
    unused: Linear,
}

impl Block {
    fn new(device: &Device) -> Self {
        Block {
            fc1: LinearConfig::new(16, 32).init(device),
            fc2: LinearConfig::new(32, 16).init(device),
            unused: LinearConfig::new(16, 16).init(device),
        }
    }

    /// `[batch, 16]` to `[batch, 16]`.
    fn plain(&self, x: Tensor<2>) -> Tensor<2> {
        RUNS.with(|runs| runs.set(runs.get() + 1));
        let h = burn::tensor::activation::relu(self.fc1.forward(x.clone()));
        self.fc2.forward(h).tanh() + x.mul_scalar(0.5).exp()
    }

    fn forward(&self, x: Tensor<2>, checkpointed: bool) -> Tensor<2> {
        if checkpointed {
            checkpoint(self, x, |block: &Block, x| block.plain(x))
        } else {
            self.plain(x)
        }
    }
}

#[derive(Module, Debug)]
struct Net {
    stem: Linear,
    blocks: Vec<Block>,
}

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            stem: LinearConfig::new(8, 16).init(device),
            blocks: vec![Block::new(device), Block::new(device)],
        }
    }
}

fn data(device: &Device, seed: u64, shape: [usize; 2]) -> Tensor<2> {
    let values: Vec<f32> = (0..shape[0] * shape[1])
        .map(|i| ((i as u64 * 2_654_435_761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// The net on `x0`: a stem, then the blocks (a Burn op before them: their input is a non-leaf
/// node), then a Burn op after; the gradients of the parameters and of `x0`.
fn gradients(net: &Net, x0: &Tensor<2>, checkpointed: bool) -> Vec<Option<Vec<u32>>> {
    let mut x = net.stem.forward(x0.clone()).mul_scalar(1.5);
    for block in &net.blocks {
        x = block.forward(x, checkpointed);
    }
    let grads = x.powi_scalar(2).sum().backward();
    let mut all = grad_bits(net, &grads);
    all.push(x0.grad(&grads).map(bits));
    all
}

#[test]
fn checkpointed_blocks_give_the_plain_gradients_bit_for_bit_under_both_burn_strategies() {
    watchdog(120, || {
        for (name, device) in devices() {
            let net = Net::new(&device);
            let x0 = data(&device, 9, [4, 8]).require_grad();
            let plain = gradients(&net, &x0, false);
            let checkpointed = gradients(&net, &x0, true);
            let present: Vec<bool> = plain.iter().map(Option::is_some).collect();
            // stem (2), each block: fc1 (2), fc2 (2), unused (2), and x0.
            assert_eq!(
                present,
                [
                    true, true, true, true, true, true, false, false, true, true, true, true,
                    false, false, true
                ],
                "{name}: the plain run"
            );
            assert_eq!(plain, checkpointed, "{name}");
        }
    });
}

#[test]
fn each_segment_runs_twice_with_checkpointing_and_once_without() {
    watchdog(120, || {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let x0 = data(&device, 3, [2, 8]).require_grad();
        for checkpointed in [true, false] {
            let before = runs();
            let x = net.stem.forward(x0.clone());
            let y = net.blocks[0].forward(x, checkpointed);
            assert_eq!(runs() - before, 1, "the forward ran the segment once");
            let _ = y.sum().backward();
            assert_eq!(
                runs() - before,
                if checkpointed { 2 } else { 1 },
                "checkpointed: {checkpointed}"
            );
        }
    });
}

/// A block whose forward ignores its input (it uses its own parameters only).
#[derive(Module, Debug)]
struct Ignores {
    bias: Param<Tensor<2>>,
}

#[test]
fn an_input_a_later_segment_ignores_gives_what_plain_gives_but_zeros_behind_a_burn_op() {
    watchdog(120, || {
        for (name, device) in devices() {
            let block = Block::new(&device);
            let ignores = Ignores {
                bias: Param::from_tensor(data(&device, 5, [4, 16])),
            };
            let x0 = data(&device, 1, [4, 16]).require_grad();
            let run = |checkpointed: bool, also_used: bool| {
                let x = block.forward(x0.clone().mul_scalar(2.0), checkpointed);
                let y = if checkpointed {
                    checkpoint(&ignores, x.clone(), |m: &Ignores, _x| m.bias.val().sin())
                } else {
                    ignores.bias.val().sin()
                };
                // Where `x` also reaches the loss through a Burn op, its gradient is the op's alone.
                let loss = if also_used {
                    y.sum() + x.sum()
                } else {
                    y.sum()
                };
                let grads = loss.backward();
                let mut all = grad_bits(&block, &grads);
                all.extend(grad_bits(&ignores, &grads));
                all.push(x0.grad(&grads).map(bits));
                all
            };
            for also_used in [false, true] {
                let mut plain = run(false, also_used);
                let mut checkpointed = run(true, also_used);
                assert_eq!(
                    plain[0].is_some(),
                    also_used,
                    "{name}: plain, fc1 reached only through the Burn op"
                );
                if !also_used {
                    // The one difference, "none" against "zeros": `x0 * 2` is a Burn op in the
                    // backward pass (through the segments' nodes), whose step must be given a
                    // gradient; zeros are its true value.
                    let x0_checkpointed = checkpointed.pop().unwrap();
                    assert_eq!(plain.pop().unwrap(), None, "{name}");
                    assert!(
                        x0_checkpointed
                            .is_some_and(|g| g.iter().all(|b| f32::from_bits(*b) == 0.0)),
                        "{name}: x0 gets zeros"
                    );
                }
                assert_eq!(plain, checkpointed, "{name}, also used: {also_used}");
            }
        }
    });
}

#[test]
fn a_segment_without_a_tracked_input_runs_as_written_once() {
    watchdog(120, || {
        let device = Device::flex().autodiff();
        let block = Block::new(&device);
        // An input that does not require grad (an image batch): MMCV's guard.
        let x = data(&device, 2, [2, 16]);
        let before = runs();
        let y = checkpoint(&block, x.clone(), |block: &Block, x| block.plain(x));
        let grads = y.sum().backward();
        assert_eq!(runs() - before, 1, "run as written, never again");
        let plain_grads = block.plain(x).sum().backward();
        assert_eq!(grad_bits(&block, &grads), grad_bits(&block, &plain_grads));
    });
}

#[test]
fn several_outputs_and_int_constants_cross_the_boundary() {
    watchdog(120, || {
        for (name, device) in devices() {
            let block = Block::new(&device);
            let x0 = data(&device, 4, [3, 16]).require_grad();
            let labels =
                Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 2, 1], [3]), &device);
            let segment = |block: &Block, (x, labels): (Tensor<2>, Tensor<1, Int>)| {
                let y = block.plain(x.clone());
                let picked = y.clone().select(1, labels.clone());
                (y.sin(), picked, labels, x.cos())
            };
            let run = |checkpointed: bool| {
                let input = (x0.clone().mul_scalar(0.25), labels.clone());
                let (a, b, labels_out, c) = if checkpointed {
                    checkpoint(&block, input, segment)
                } else {
                    segment(&block, input)
                };
                assert_eq!(
                    labels_out
                        .into_data()
                        .convert::<i64>()
                        .as_slice::<i64>()
                        .unwrap(),
                    [0, 2, 1]
                );
                // `c` is not used: its output node never runs.
                let _ = c;
                let grads = (a.sum() + b.powi_scalar(2).sum()).backward();
                let mut all = grad_bits(&block, &grads);
                all.push(x0.grad(&grads).map(bits));
                all
            };
            assert_eq!(run(false), run(true), "{name}");
        }
    });
}

/// A block that reads a tensor captured from outside (not its input, not a parameter).
#[test]
fn a_segment_that_captures_a_tracked_tensor_runs_plainly_with_the_right_gradients() {
    watchdog(120, || {
        let device = Device::flex().autodiff();
        let block = Block::new(&device);
        let x0 = data(&device, 6, [2, 16]).require_grad();
        let captured = data(&device, 8, [2, 16]).require_grad();
        let run = |checkpointed: bool| {
            let outside = captured.clone();
            let y = if checkpointed {
                checkpoint(&block, x0.clone(), move |block: &Block, x| {
                    block.plain(x) * outside.clone()
                })
            } else {
                block.plain(x0.clone()) * captured.clone()
            };
            let grads = y.sum().backward();
            let mut all = grad_bits(&block, &grads);
            all.push(x0.grad(&grads).map(bits));
            all.push(captured.grad(&grads).map(bits));
            all
        };
        let plain = run(false);
        assert!(plain.last().unwrap().is_some());
        assert_eq!(plain, run(true));
    });
}

/// A parameter made by Burn's ops (not a leaf), which the segment does not use: its node is in
/// the backward pass (through the segment's nodes) and gets zeros, its true value, rather than
/// nothing (Burn's step for it would panic on none).
#[test]
fn a_parameter_made_by_burn_ops_that_the_segment_does_not_use_gets_zeros() {
    watchdog(120, || {
        for (name, device) in devices() {
            let base = data(&device, 12, [4, 16]).require_grad();
            let ignores = Ignores {
                bias: Param::from_tensor(base.clone()).map(|tensor| tensor.mul_scalar(2.0)),
            };
            let x0 = data(&device, 13, [4, 16]).require_grad();
            let y = checkpoint(&ignores, x0.clone(), |_: &Ignores, x| x.sin());
            let grads = y.sum().backward();
            let plain = x0.clone().sin().sum().backward();
            assert_eq!(
                x0.grad(&grads).map(bits),
                x0.grad(&plain).map(bits),
                "{name}"
            );
            let zeros = base.grad(&grads).map(bits);
            assert!(
                zeros.is_some_and(|g| g.iter().all(|b| f32::from_bits(*b) == 0.0)),
                "{name}: the base of the unused parameter gets zeros"
            );
        }
    });
}
