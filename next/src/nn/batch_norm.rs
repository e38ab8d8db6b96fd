//! memsave's BatchNorm on Burn 0.22: PyTorch's semantics, fp32 statistics of a half input, and
//! the ReLU fused (`forward_relu`).

use burn::module::{Module, Param, RunningState};
use burn::prelude::*;

use burn::nn::conv::Conv2d;
use burn::nn::PaddingConfig2d;
use burn::tensor::ops::ConvOptions;

use super::fused::{normalise_relu_conv, Conv};
use super::ops::{normalise, Norm, Normalised, Statistics};
use super::view::{Act, Grouping, View};
use crate::fp16::{Fp16, Fp16Module, HasFp16Flag, Precision};

/// Configuration of a [`BatchNorm`] layer (PyTorch's `BatchNorm2d` defaults).
#[derive(Config, Debug)]
pub struct BatchNormConfig {
    /// Number of channels (`C` of `[N, C, ...]`).
    pub num_features: usize,
    /// Added to the variance for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Weight of the current batch in the running statistics.
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl BatchNormConfig {
    /// A layer with `gamma = 1`, `beta = 0`, running mean 0 and running variance 1.
    pub fn init(&self, device: &Device) -> BatchNorm {
        BatchNorm {
            gamma: Param::from_tensor(Tensor::ones([self.num_features], device)),
            beta: Param::from_tensor(Tensor::zeros([self.num_features], device)),
            running_mean: RunningState::new(Tensor::zeros([self.num_features], device)),
            running_var: RunningState::new(Tensor::ones([self.num_features], device)),
            momentum: self.momentum,
            epsilon: self.epsilon,
            eval: false,
            fp16_enabled: Fp16::Off,
        }
    }
}

/// Batch normalisation over `[batch, channels, ...]` with PyTorch's semantics, that stays in
/// fp32 inside a half-precision model.
///
/// On an autodiff device it normalises with the batch statistics and updates the running ones
/// (the running variance with the unbiased batch variance, as PyTorch; Burn's uses the biased
/// one); otherwise, or in eval mode ([`BatchNorm::with_eval`]: PyTorch's `.eval()`,
/// MMDetection's `norm_eval`), it normalises with the running statistics and leaves them alone,
/// gradients still flowing. One autodiff operation keeping its input and two fp32 numbers per
/// channel, as Burn 0.22's own; `forward_relu` keeps nothing more for its ReLU. Inside a
/// checkpointed segment the running statistics move once per step (memsave's segments put them
/// back around the recomputation).
#[derive(Module, Debug)]
pub struct BatchNorm {
    /// Scale, `[channels]`.
    pub gamma: Param<Tensor<1>>,
    /// Shift, `[channels]`.
    pub beta: Param<Tensor<1>>,
    /// Running mean, `[channels]`.
    pub running_mean: RunningState<Tensor<1>>,
    /// Running variance, `[channels]`.
    pub running_var: RunningState<Tensor<1>>,
    /// Weight of the current batch in the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// Eval mode: the running statistics normalise, also in training, and do not move.
    pub eval: bool,
    /// On: the output is cast to half (the input is read in its own type).
    pub fp16_enabled: Fp16,
}

impl BatchNorm {
    /// In eval mode (`true`) or training mode (`false`), as PyTorch's `.eval()` / `.train()`.
    pub fn with_eval(self, eval: bool) -> Self {
        BatchNorm { eval, ..self }
    }

    /// Normalises `input` per channel.
    ///
    /// - input: `[batch, channels, ...]`, fp32 or half (read as it is: statistics,
    ///   parameters and arithmetic are fp32)
    /// - output: the shape of `input`; its float type, or half when the flag is on
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_act(input, Act::Identity)
    }

    /// `relu(self.forward(input))` as one operation: the ReLU's mask is recomputed from the
    /// input in backward, so the pair keeps only the input (Burn's ReLU would keep its own).
    pub fn forward_relu<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_act(input, Act::Relu)
    }

    /// `conv.forward(relu(self.forward(input)))` as one operation that keeps only `input` (and
    /// two numbers per channel): the ReLU's output, which the convolution would keep for its
    /// weight gradient, is recomputed from `input` in backward (In-Place Activated BatchNorm's
    /// saving, exact for a ReLU). Where the input's type is not the convolution's (a half
    /// model fed fp32), the two steps run as they are.
    ///
    /// - input: `[batch, channels, height, width]`
    /// - output: the convolution's, `[batch, channels_out, height_out, width_out]`
    pub fn forward_relu_conv(&self, input: Tensor<4>, conv: &Conv2d) -> Tensor<4> {
        let weight = conv.weight.val();
        if input.dtype() != weight.dtype() {
            return conv.forward(self.forward_relu(input));
        }
        let [_, _, height, width] = input.dims();
        let conv = Conv {
            weight,
            bias: conv.bias.as_ref().map(|bias| bias.val()),
            options: conv_options(conv, height, width),
        };
        let (statistics, norm) = self.prepare(&input.dims(), &input, Act::Relu);
        let out = normalise_relu_conv(
            input,
            self.gamma.val(),
            self.beta.val(),
            statistics,
            norm,
            conv,
        );
        self.update(out, norm)
    }

    fn forward_act<const D: usize>(&self, input: Tensor<D>, act: Act) -> Tensor<D> {
        let (statistics, norm) = self.prepare(&input.dims(), &input, act);
        let out = normalise(input, self.gamma.val(), self.beta.val(), statistics, norm);
        self.fp16_enabled.to_half(self.update(out, norm))
    }

    /// The statistics an input of `dims` is normalised with, and the op's settings.
    fn prepare<const D: usize>(
        &self,
        dims: &[usize; D],
        input: &Tensor<D>,
        act: Act,
    ) -> (Statistics, Norm) {
        let [channels] = self.gamma.val().dims();
        assert!(
            D >= 2 && dims[1] == channels,
            "BatchNorm over {channels} channels got an input of shape {dims:?}"
        );
        let view = View {
            outer: dims[0],
            channels,
            inner: dims[2..].iter().product(),
        };
        let training = input.device().is_autodiff() && !self.eval;
        let statistics = if training {
            Statistics::Batch
        } else {
            Statistics::Running {
                mean: self.running_mean.value(),
                var: self.running_var.value(),
            }
        };
        let norm = Norm {
            view,
            grouping: Grouping::PerChannel,
            act,
            epsilon: self.epsilon,
        };
        (statistics, norm)
    }

    /// The running statistics moved by the batch's (where it had them); the output.
    fn update<const D: usize>(&self, out: Normalised<D>, norm: Norm) -> Tensor<D> {
        if let Some((mean, var)) = out.batch_stats {
            // PyTorch's running variance: the unbiased batch variance.
            let n = norm.view.group_size(Grouping::PerChannel) as f64;
            let var = if n > 1.0 {
                var.mul_scalar(n / (n - 1.0))
            } else {
                var
            };
            let m = self.momentum;
            let mean = self.running_mean.value_sync().mul_scalar(1.0 - m) + mean.mul_scalar(m);
            let var = self.running_var.value_sync().mul_scalar(1.0 - m) + var.mul_scalar(m);
            self.running_mean.update(mean.detach());
            self.running_var.update(var.detach());
        }
        out.output
    }
}

/// `conv`'s options on an input of `height` x `width` (Burn's and PyTorch's `same` padding,
/// asymmetric for an even kernel).
fn conv_options(conv: &Conv2d, height: usize, width: usize) -> ConvOptions<2> {
    let same = |kernel: usize, stride: usize, size: usize| {
        let out = size.div_ceil(stride);
        let total = if out > 0 {
            ((out - 1) * stride + kernel).saturating_sub(size)
        } else {
            0
        };
        (total / 2, total - total / 2)
    };
    let padding = match conv.padding {
        PaddingConfig2d::Valid => [(0, 0), (0, 0)],
        PaddingConfig2d::Explicit(top, left, bottom, right) => [(top, bottom), (left, right)],
        PaddingConfig2d::Same => [
            same(conv.kernel_size[0], conv.stride[0], height),
            same(conv.kernel_size[1], conv.stride[1], width),
        ],
    };
    ConvOptions::new_with_padding(conv.stride, padding, conv.dilation, conv.groups)
}

impl HasFp16Flag for BatchNorm {
    fn fp16_enabled(&self) -> Fp16 {
        self.fp16_enabled
    }
}

/// Parameters and running statistics stay fp32; only the flag is switched on.
impl Fp16Module for BatchNorm {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Self {
            fp16_enabled: Fp16::On(precision),
            ..self
        }
    }
}
