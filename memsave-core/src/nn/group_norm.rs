use burn::module::{Module, Param};
use burn::prelude::{Backend, Config};
use burn::tensor::{Tensor, TensorPrimitive};

use super::kernels::{Act, Grouping, View};
use super::ops::{self, Statistics};

use crate::fp16::{Fp16, Fp16Module, HasFp16Flag, Precision};

/// Configuration of a [`GroupNorm`] layer (PyTorch's `GroupNorm` defaults).
#[derive(Config, Debug)]
pub struct GroupNormConfig {
    /// Number of groups the channels are split into; must divide `num_channels`.
    pub num_groups: usize,
    /// Number of channels (`C` of `[N, C, ...]`).
    pub num_channels: usize,
    /// Added to the variance for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl GroupNormConfig {
    /// A layer with `gamma = 1`, `beta = 0`.
    ///
    /// # Panics
    /// If `num_groups` is zero or does not divide `num_channels` (a programming error in the
    /// model definition, not a user input).
    pub fn init<B: Backend>(&self, device: &B::Device) -> GroupNorm<B> {
        assert!(
            self.num_groups > 0 && self.num_channels.is_multiple_of(self.num_groups),
            "GroupNorm: num_groups ({}) must divide num_channels ({})",
            self.num_groups,
            self.num_channels
        );
        GroupNorm {
            gamma: Param::from_tensor(Tensor::ones([self.num_channels], device)),
            beta: Param::from_tensor(Tensor::zeros([self.num_channels], device)),
            num_groups: self.num_groups,
            epsilon: self.epsilon,
            fp16_enabled: Fp16::Off,
        }
    }
}

/// Group normalisation over `[batch, channels, ...]` that stays in fp32 inside a
/// half-precision model.
#[derive(Module, Debug)]
pub struct GroupNorm<B: Backend> {
    /// Scale, `[channels]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[channels]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Number of channel groups.
    pub num_groups: usize,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// On: the input is cast to fp32 and the output back to half.
    pub fp16_enabled: Fp16,
}

impl<B: Backend> GroupNorm<B> {
    /// Normalises `input` over each group of channels and its positions.
    ///
    /// - input: `[batch, channels, ...]`, fp32, or half when the fp16 flag is on (kept half;
    ///   statistics and arithmetic fp32)
    /// - output: the shape of `input`; its float type, or half when the flag is on
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_act(input, Act::Identity)
    }

    /// `relu(self.forward(input))` as one operation that keeps only the input.
    pub fn forward_relu<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_act(input, Act::Relu)
    }

    fn forward_act<const D: usize>(&self, input: Tensor<B, D>, act: Act) -> Tensor<B, D> {
        assert!(
            D >= 2,
            "GroupNorm takes [batch, channels, ...], got a {D}-d tensor"
        );
        let dims = input.dims();
        let view = View {
            outer: dims[0],
            channels: dims[1],
            inner: dims[2..].iter().product(),
        };
        assert_eq!(
            view.channels,
            self.gamma.shape().num_elements(),
            "GroupNorm over {} channels got an input with {}",
            self.gamma.shape().num_elements(),
            view.channels
        );
        let out = ops::normalise::<B>(
            input.into_primitive().tensor(),
            self.gamma.val().into_primitive().tensor(),
            self.beta.val().into_primitive().tensor(),
            Statistics::Batch,
            view,
            Grouping::PerSampleGroup {
                groups: self.num_groups,
            },
            act,
            self.epsilon,
        );
        let output = Tensor::from_primitive(TensorPrimitive::Float(out.output));
        self.fp16_enabled.to_half(output)
    }
}

impl<B: Backend> HasFp16Flag for GroupNorm<B> {
    fn fp16_enabled(&self) -> Fp16 {
        self.fp16_enabled
    }
}

/// Parameters stay fp32; only the flag is switched on.
impl<B: Backend> Fp16Module for GroupNorm<B> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Self {
            fp16_enabled: Fp16::On(precision),
            ..self
        }
    }
}
