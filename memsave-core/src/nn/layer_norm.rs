use burn::module::{Module, Param};
use burn::prelude::{Backend, Config};
use burn::tensor::{Tensor, TensorPrimitive};

use super::kernels::{Act, Grouping, View};
use super::ops::{self, Statistics};
use crate::fp16::{Fp16, Fp16Module, HasFp16Flag, Precision};

/// Configuration of a [`LayerNorm`] layer (PyTorch's `LayerNorm` over the last dimension).
#[derive(Config, Debug)]
pub struct LayerNormConfig {
    /// Size of the last dimension, which is normalised.
    pub d_model: usize,
    /// Added to the variance for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl LayerNormConfig {
    /// A layer with `gamma = 1`, `beta = 0`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> LayerNorm<B> {
        LayerNorm {
            gamma: Param::from_tensor(Tensor::ones([self.d_model], device)),
            beta: Param::from_tensor(Tensor::zeros([self.d_model], device)),
            epsilon: self.epsilon,
            fp16_enabled: Fp16::Off,
        }
    }
}

/// Layer normalisation over the last dimension that stays in fp32 inside a half-precision
/// model, as one operation that keeps its input and two fp32 numbers per row for backward.
///
/// Burn's `LayerNorm` run in f16 under autodiff loses rows whose deviation from the mean
/// exceeds about 256 (they come out 0); this one computes in fp32 whatever its input's type.
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// Scale, `[d_model]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[d_model]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// On: the output is cast to half (the input is read in its own type).
    pub fp16_enabled: Fp16,
}

impl<B: Backend> LayerNorm<B> {
    /// - input: `[..., d_model]`
    /// - output: the shape of `input`; its float type, or half when the flag is on
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let dims = input.dims();
        let features = dims[D - 1];
        assert_eq!(
            features,
            self.gamma.shape().num_elements(),
            "LayerNorm over {} features got an input whose last dimension is {features}",
            self.gamma.shape().num_elements(),
        );
        let view = View {
            outer: dims[..D - 1].iter().product(),
            channels: 1,
            inner: features,
        };
        let out = ops::normalise::<B>(
            input.into_primitive().tensor(),
            self.gamma.val().into_primitive().tensor(),
            self.beta.val().into_primitive().tensor(),
            Statistics::Batch,
            view,
            Grouping::PerRow,
            Act::Identity,
            self.epsilon,
        );
        let output = Tensor::from_primitive(TensorPrimitive::Float(out.output));
        self.fp16_enabled.to_half(output)
    }
}

impl<B: Backend> HasFp16Flag for LayerNorm<B> {
    fn fp16_enabled(&self) -> Fp16 {
        self.fp16_enabled
    }
}

/// Parameters stay fp32; only the flag is switched on.
impl<B: Backend> Fp16Module for LayerNorm<B> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Self {
            fp16_enabled: Fp16::On(precision),
            ..self
        }
    }
}
