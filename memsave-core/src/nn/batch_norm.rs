use crate::fp16::PrecisionExt;
use burn::module::{Module, Param, RunningState};
use burn::prelude::{Backend, Config};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::conv::{conv_options, conv_output_dims};
use super::kernels::{Act, Grouping, View};
use super::ops::{self, ConvSpec, NormSpec, PoolSpec, Statistics};
use super::pool::pool_padding;
use burn::nn::conv::Conv2d;
use burn::nn::pool::MaxPool2d;

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
    pub fn init<B: Backend>(&self, device: &B::Device) -> BatchNorm<B> {
        // Each its own tensor: under autodiff a clone shares its node, and marking the
        // parameter as requiring grad would make the running statistics tracked too.
        let ones = || Tensor::ones([self.num_features], device);
        let zeros = || Tensor::zeros([self.num_features], device);
        BatchNorm {
            gamma: Param::from_tensor(ones()),
            beta: Param::from_tensor(zeros()),
            running_mean: RunningState::new(zeros()),
            running_var: RunningState::new(ones()),
            momentum: self.momentum,
            epsilon: self.epsilon,
            eval: false,
            fp16_enabled: Fp16::Off,
        }
    }
}

/// Batch normalisation over `[batch, channels, ...]`, with PyTorch's semantics, that stays in
/// fp32 inside a half-precision model.
///
/// On an autodiff backend it normalises with the batch statistics and updates the running ones
/// (running variance with the unbiased batch variance, as PyTorch); otherwise, or in eval mode
/// ([`BatchNorm::with_eval`]: PyTorch's `.eval()`, MMDetection's `norm_eval`), it normalises
/// with the running statistics and leaves them alone, gradients still flowing. Inside a checkpointed segment the running statistics are updated
/// in the first forward only, not again in the recomputation.
#[derive(Module, Debug)]
pub struct BatchNorm<B: Backend> {
    /// Scale, `[channels]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[channels]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Running mean, `[channels]`.
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// Running variance, `[channels]`.
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Weight of the current batch in the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// Eval mode: the running statistics normalise, also in training, and do not move.
    pub eval: bool,
    /// On: the input is cast to fp32 and the output back to half.
    pub fp16_enabled: Fp16,
}

impl<B: Backend> BatchNorm<B> {
    /// In eval mode (`true`) or training mode (`false`), as PyTorch's `.eval()` / `.train()`.
    pub fn with_eval(self, eval: bool) -> Self {
        BatchNorm { eval, ..self }
    }

    /// Normalises `input` per channel.
    ///
    /// - input: `[batch, channels, ...]`, fp32, or half when the fp16 flag is on (kept half:
    ///   statistics and parameters are fp32, the arithmetic is fp32, nothing fp32 of the
    ///   input's size is kept)
    /// - output: the shape of `input`; its float type, or half when the flag is on
    ///
    /// On an autodiff backend it is one operation that keeps its input and two fp32 numbers per
    /// channel for backward (see [`crate::nn`]).
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_act(input, Act::Identity)
    }

    /// `relu(self.forward(input))` as one operation: the ReLU's mask is recomputed from the
    /// input in backward, so the pair keeps only the input (Burn's ReLU would keep its own).
    pub fn forward_relu<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_act(input, Act::Relu)
    }

    /// `conv.forward(relu(self.forward(input)))` as one operation that keeps only `input` (and
    /// two numbers per channel): the ReLU's output, which the convolution would keep for its
    /// weight gradient, is recomputed from `input` in backward. This is In-Place Activated
    /// BatchNorm's saving, made exact for a ReLU (In-Place ABN inverts the activation). A convolution
    /// with asymmetric `Same` padding, or a half model fed fp32, runs the two steps as they are.
    ///
    /// - input: `[batch, channels, height, width]`
    /// - output: the convolution's, `[batch, channels_out, height_out, width_out]`
    pub fn forward_relu_conv(&self, input: Tensor<B, 4>, conv: &Conv2d<B>) -> Tensor<B, 4> {
        let half_mismatch = self
            .fp16_enabled
            .precision()
            .is_some_and(|precision| input.dtype() != precision.dtype());
        let Some(options) = conv_options(conv, input.dims()).filter(|_| !half_mismatch) else {
            return crate::nn::conv2d(conv, self.forward_relu(input));
        };
        let device = input.device();
        let (view, statistics) = self.prepare(&input);
        let out = ops::norm_act_conv::<B>(
            input.into_primitive().tensor(),
            self.spec(view, statistics, Act::Relu),
            conv_spec(conv, options),
        );
        self.after(out.batch_stats, view, &device);
        Tensor::from_primitive(TensorPrimitive::Float(out.output))
    }

    /// `self.forward(conv.forward(input))` as one operation that keeps only `input` (and two
    /// numbers per channel): the convolution's output, which the normalisation would keep, is
    /// recomputed from `input` in backward, at the cost of one more convolution. It saves an
    /// activation-sized tensor where `input` is kept by another op anyway, as a ResNet's
    /// downsample, whose input the block's first convolution keeps. A convolution with
    /// asymmetric `Same` padding, or an input of another float type than the weights, runs
    /// the two steps as they are; so does the recomputation of a checkpointed segment, whose
    /// tensors live only until the segment's backward is done (the same gradients, without
    /// computing the convolution a third time).
    ///
    /// - input: `[batch, channels_in, height, width]`
    /// - output: `[batch, channels_out, height_out, width_out]`
    pub fn forward_after_conv(&self, conv: &Conv2d<B>, input: Tensor<B, 4>) -> Tensor<B, 4> {
        let mismatch = input.dtype() != conv.weight.val().dtype()
            || crate::checkpoint::context::is_recomputing_segment();
        let Some(options) = conv_options(conv, input.dims()).filter(|_| !mismatch) else {
            return self.forward(crate::nn::conv2d(conv, input));
        };
        let device = input.device();
        let dims = conv_output_dims(conv, input.dims(), &options);
        let (view, statistics) = self.prepare_dims(&dims, &device);
        let out = ops::conv_norm::<B>(
            input.into_primitive().tensor(),
            conv_spec(conv, options),
            self.spec(view, statistics, Act::Identity),
        );
        self.after(out.batch_stats, view, &device);
        let output = Tensor::from_primitive(TensorPrimitive::Float(out.output));
        self.fp16_enabled.to_half(output)
    }

    /// `max_pool2d(pool, self.forward_relu(input))` as one operation that keeps only `input`
    /// (and two numbers per channel): the ReLU's output and the maxima's indices are recomputed
    /// from `input` in backward (elementwise, and one pooling), so the pooling's indices (8
    /// bytes per output element) are not kept. A ResNet's stem. Asymmetric `Same` padding runs
    /// the two steps as they are.
    ///
    /// - input: `[batch, channels, height, width]`
    /// - output: `[batch, channels, height_out, width_out]`
    pub fn forward_relu_max_pool(&self, input: Tensor<B, 4>, pool: &MaxPool2d) -> Tensor<B, 4> {
        let Some(padding) = pool_padding(pool, input.dims()) else {
            return crate::nn::max_pool2d(pool, self.forward_relu(input));
        };
        let device = input.device();
        let (view, statistics) = self.prepare(&input);
        let out = ops::norm_act_pool::<B>(
            input.into_primitive().tensor(),
            self.spec(view, statistics, Act::Relu),
            PoolSpec {
                kernel: pool.kernel_size,
                stride: pool.stride,
                padding,
                dilation: pool.dilation,
                ceil_mode: pool.ceil_mode,
            },
        );
        self.after(out.batch_stats, view, &device);
        let output = Tensor::from_primitive(TensorPrimitive::Float(out.output));
        self.fp16_enabled.to_half(output)
    }

    /// This layer's parameters as the ops take them.
    fn spec(&self, view: View, statistics: Statistics<B>, act: Act) -> NormSpec<B> {
        NormSpec {
            gamma: self.gamma.val().into_primitive().tensor(),
            beta: self.beta.val().into_primitive().tensor(),
            statistics,
            view,
            grouping: Grouping::PerChannel,
            act,
            epsilon: self.epsilon,
        }
    }

    fn forward_act<const D: usize>(&self, input: Tensor<B, D>, act: Act) -> Tensor<B, D> {
        let device = input.device();
        let (view, statistics) = self.prepare(&input);
        let out = ops::normalise::<B>(
            input.into_primitive().tensor(),
            self.gamma.val().into_primitive().tensor(),
            self.beta.val().into_primitive().tensor(),
            statistics,
            view,
            Grouping::PerChannel,
            act,
            self.epsilon,
        );
        self.after(out.batch_stats, view, &device);
        let output = Tensor::from_primitive(TensorPrimitive::Float(out.output));
        self.fp16_enabled.to_half(output)
    }

    /// The view of `input` and the statistics to use: the batch's under autodiff (training),
    /// the running ones otherwise.
    fn prepare<const D: usize>(&self, input: &Tensor<B, D>) -> (View, Statistics<B>) {
        assert!(
            D >= 2,
            "BatchNorm takes [batch, channels, ...], got a {D}-d tensor"
        );
        self.prepare_dims(&input.dims(), &input.device())
    }

    /// [`BatchNorm::prepare`] for an input of `dims` on `device`.
    fn prepare_dims(&self, dims: &[usize], device: &B::Device) -> (View, Statistics<B>) {
        let view = View {
            outer: dims[0],
            channels: dims[1],
            inner: dims[2..].iter().product(),
        };
        assert_eq!(
            view.channels,
            self.gamma.shape().num_elements(),
            "BatchNorm over {} channels got an input with {}",
            self.gamma.shape().num_elements(),
            view.channels
        );
        let statistics = if B::ad_enabled(device) && !self.eval {
            // In a checkpointed segment's recomputation: the statistics of its first forward.
            match crate::checkpoint::context::replayed::<BatchStats<B>>() {
                Some(BatchStats(mean, var)) => Statistics::Recorded {
                    mean: mean.into_primitive().tensor(),
                    var: var.into_primitive().tensor(),
                },
                None => Statistics::Batch,
            }
        } else {
            Statistics::Running {
                // Constants: no gradient flows into the statistics, whatever they came from.
                mean: self
                    .running_mean
                    .value()
                    .detach()
                    .to_device(device)
                    .into_primitive()
                    .tensor(),
                var: self
                    .running_var
                    .value()
                    .detach()
                    .to_device(device)
                    .into_primitive()
                    .tensor(),
            }
        };
        (view, statistics)
    }

    /// After a forward with batch statistics: the running ones move, in a checkpointed
    /// segment's first forward only (PyTorch moves them in both).
    fn after(
        &self,
        batch_stats: Option<(FloatTensor<B>, FloatTensor<B>)>,
        view: View,
        device: &B::Device,
    ) {
        if let Some((mean, var)) = batch_stats {
            let (mean, var) = (
                Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(mean)),
                Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(var)),
            );
            // For the recomputation of the segments run for the first time (none outside).
            crate::checkpoint::context::record(&BatchStats(mean.clone(), var.clone()));
            if !crate::checkpoint::is_recomputing() {
                self.update_running(mean, var, view.outer * view.inner, device);
            }
        }
    }

    /// `running = (1 - momentum) * running + momentum * batch`, the variance unbiased (as
    /// PyTorch).
    fn update_running(
        &self,
        mean: Tensor<B, 1>,
        var: Tensor<B, 1>,
        count: usize,
        device: &B::Device,
    ) {
        let unbiased = if count > 1 {
            count as f64 / (count - 1) as f64
        } else {
            1.0
        };
        let running_mean = self.running_mean.value_sync().to_device(device);
        let running_var = self.running_var.value_sync().to_device(device);
        self.running_mean
            .update(running_mean.mul_scalar(1.0 - self.momentum) + mean.mul_scalar(self.momentum));
        self.running_var.update(
            running_var.mul_scalar(1.0 - self.momentum) + var.mul_scalar(self.momentum * unbiased),
        );
    }
}

/// `conv`'s parameters as the ops take them.
fn conv_spec<B: Backend>(
    conv: &Conv2d<B>,
    options: burn::tensor::ops::ConvOptions<2>,
) -> ConvSpec<B> {
    ConvSpec {
        weight: crate::nn::frozen::weight_of(&conv.weight, conv.weight.val().dtype())
            .into_primitive()
            .tensor(),
        bias: conv
            .bias
            .as_ref()
            .map(|bias| bias.val().into_primitive().tensor()),
        options,
    }
}

/// A batch's mean and biased variance, recorded by a checkpointed segment's first forward.
#[derive(Clone)]
struct BatchStats<B: Backend>(Tensor<B, 1>, Tensor<B, 1>);

impl<B: Backend> HasFp16Flag for BatchNorm<B> {
    fn fp16_enabled(&self) -> Fp16 {
        self.fp16_enabled
    }
}

/// Parameters and statistics stay fp32; only the flag is switched on.
impl<B: Backend> Fp16Module for BatchNorm<B> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Self {
            fp16_enabled: Fp16::On(precision),
            ..self
        }
    }
}
