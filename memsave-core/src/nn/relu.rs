use burn::module::Module;
use burn::prelude::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use super::ops;
use crate::fp16::{Fp16Module, Precision};

/// ReLU that keeps its output for backward, not its input as Burn's does: the output is the
/// next layer's input, which that layer keeps anyway, so the ReLU costs no memory of its own
/// (PyTorch reaches the same with `inplace=True`).
#[derive(Module, Clone, Debug, Default)]
pub struct Relu;

impl Relu {
    /// A ReLU.
    pub fn new() -> Self {
        Relu
    }

    /// - input: any shape
    /// - output: the shape of `input`
    pub fn forward<B: Backend, const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        relu(input)
    }
}

/// `max(0, x)`, keeping its output for backward (see [`Relu`]).
pub fn relu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(ops::relu::<B>(
        x.into_primitive().tensor(),
    )))
}

/// `a + b` for tensors of one shape (a residual add), keeping nothing for backward under any
/// autodiff checkpoint strategy: Burn's `BalancedCheckpointing` keeps both inputs of its own
/// (memory-bound) add until backward starts, one activation more per residual block.
/// Tensors of different shapes are added by Burn (broadcasting).
pub fn add<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(ops::add::<B>(
        a.into_primitive().tensor(),
        b.into_primitive().tensor(),
    )))
}

impl Fp16Module for Relu {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}
