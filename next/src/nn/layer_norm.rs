//! memsave's LayerNorm and GroupNorm on Burn 0.22: one node each, keeping the input and two fp32
//! numbers per group, fp32 statistics and arithmetic whatever the input's type.

use burn::module::{Module, Param};
use burn::prelude::*;

use super::ops::{normalise, Norm, Statistics};
use super::view::{Act, Grouping, View};
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
    pub fn init(&self, device: &Device) -> LayerNorm {
        LayerNorm {
            gamma: Param::from_tensor(Tensor::ones([self.d_model], device)),
            beta: Param::from_tensor(Tensor::zeros([self.d_model], device)),
            epsilon: self.epsilon,
            fp16_enabled: Fp16::Off,
        }
    }
}

/// Layer normalisation over the last dimension as one operation that keeps its input and two
/// fp32 numbers per row for backward (Burn 0.22's `LayerNorm` keeps an activation-sized tensor
/// more, and widens a half input to an fp32 copy first). Statistics and
/// arithmetic are fp32 whatever the input's type; the output is the input's type, or half when
/// the fp16 flag is on (the parameters stay fp32: an island without a cast of the input).
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// Scale, `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// Shift, `[d_model]`.
    pub beta: Param<Tensor<1>>,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// On: the output is cast to half (the input is read in its own type).
    pub fp16_enabled: Fp16,
}

impl LayerNorm {
    /// - input: `[..., d_model]`
    /// - output: the shape of `input`; its float type, or half when the flag is on
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_act(input, Act::Identity)
    }

    /// `relu(self.forward(input))` as one operation (the ReLU's mask recomputed in backward).
    pub fn forward_relu<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_act(input, Act::Relu)
    }

    fn forward_act<const D: usize>(&self, input: Tensor<D>, act: Act) -> Tensor<D> {
        let dims = input.dims();
        let features = dims[D - 1];
        let [d_model] = self.gamma.val().dims();
        assert_eq!(
            features, d_model,
            "LayerNorm over {d_model} features got an input whose last dimension is {features}",
        );
        let norm = Norm {
            view: View {
                outer: dims[..D - 1].iter().product(),
                channels: 1,
                inner: features,
            },
            grouping: Grouping::PerRow,
            act,
            epsilon: self.epsilon,
        };
        let out = normalise(
            input,
            self.gamma.val(),
            self.beta.val(),
            Statistics::Batch,
            norm,
        );
        self.fp16_enabled.to_half(out.output)
    }
}

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
    pub fn init(&self, device: &Device) -> GroupNorm {
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

/// Group normalisation over `[batch, channels, ...]` as one operation that keeps its input and
/// two fp32 numbers per sample and group (Burn 0.22's `GroupNorm` keeps an activation-sized
/// tensor more). fp32 statistics and arithmetic whatever the input's type.
#[derive(Module, Debug)]
pub struct GroupNorm {
    /// Scale, `[channels]`.
    pub gamma: Param<Tensor<1>>,
    /// Shift, `[channels]`.
    pub beta: Param<Tensor<1>>,
    /// Number of channel groups.
    pub num_groups: usize,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// On: the output is cast to half (the input is read in its own type).
    pub fp16_enabled: Fp16,
}

impl GroupNorm {
    /// - input: `[batch, channels, ...]`
    /// - output: the shape of `input`; its float type, or half when the flag is on
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_act(input, Act::Identity)
    }

    /// `relu(self.forward(input))` as one operation (the ReLU's mask recomputed in backward).
    pub fn forward_relu<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_act(input, Act::Relu)
    }

    fn forward_act<const D: usize>(&self, input: Tensor<D>, act: Act) -> Tensor<D> {
        let dims = input.dims();
        let [channels] = self.gamma.val().dims();
        assert!(
            D >= 2 && dims[1] == channels,
            "GroupNorm over {channels} channels got an input of shape {dims:?}"
        );
        let norm = Norm {
            view: View {
                outer: dims[0],
                channels,
                inner: dims[2..].iter().product(),
            },
            grouping: Grouping::PerSampleGroup {
                groups: self.num_groups,
            },
            act,
            epsilon: self.epsilon,
        };
        let out = normalise(
            input,
            self.gamma.val(),
            self.beta.val(),
            Statistics::Batch,
            norm,
        );
        self.fp16_enabled.to_half(out.output)
    }
}

macro_rules! norm_island {
    ($($layer:ident),*) => {$(
        impl HasFp16Flag for $layer {
            fn fp16_enabled(&self) -> Fp16 {
                self.fp16_enabled
            }
        }

        /// Parameters stay fp32; only the flag is switched on.
        impl Fp16Module for $layer {
            fn wrap_fp16(self, precision: Precision) -> Self {
                Self {
                    fp16_enabled: Fp16::On(precision),
                    ..self
                }
            }
        }
    )*};
}

norm_island!(LayerNorm, GroupNorm);
