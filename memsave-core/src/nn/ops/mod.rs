//! The autodiff operations under memsave's layers: a normalisation (BatchNorm, GroupNorm,
//! LayerNorm, optionally with its ReLU) and a ReLU, each one node of Burn's graph with a
//! hand-written backward that keeps only what it needs.
//!
//! | op | keeps for backward | Burn's composed version keeps |
//! |---|---|---|
//! | normalisation (+ ReLU) | its input, and fp32 mean and 1/std per group | a transposed copy of the input, the centred input, the normalised input, the pre-ReLU output |
//! | ReLU | its output (which its consumer, a convolution, keeps anyway) | its input |
//!
//! A normalisation's input is usually a convolution's output, which nothing else keeps; its
//! output goes to a ReLU (fused here: its mask is recomputed from the input in backward), whose
//! output is the next convolution's input. So a conv-norm-ReLU keeps two activation-sized
//! tensors, as PyTorch's (whose ReLU runs in place), where Burn's composition keeps five.
//!
//! The ops run on `Autodiff<K, C>` for any [`LeanBackend`](super::kernels::LeanBackend) `K`
//! (Flex: fused loops, [`super::kernels`]; every CubeCL runtime: tensor ops) and any checkpoint
//! strategy `C`, found at run time from the tensor's type ([`dispatch`]) so that layers stay
//! generic over any `B: Backend`; on any other backend the same arithmetic runs as tensor ops
//! that Burn's autodiff differentiates.

use burn::backend::Autodiff;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{ConvOptions, FloatTensor};

use super::kernels::{Act, Grouping, NormKernels, View};

/// The statistics a normalisation uses.
pub(crate) enum Statistics<B: Backend> {
    /// Those of this input (training BatchNorm, GroupNorm, LayerNorm).
    Batch,
    /// Those of this input, as computed by a checkpointed segment's first forward and replayed
    /// in its recomputation (the same bits): as `Batch`, without a pass over the input. On
    /// backends whose statistics are tensor ops (differentiated by Burn), computed again.
    Recorded {
        mean: FloatTensor<B>,
        var: FloatTensor<B>,
    },
    /// Given ones, constants (BatchNorm in eval mode): mean and biased variance, `[groups]`.
    Running {
        mean: FloatTensor<B>,
        var: FloatTensor<B>,
    },
}

/// A normalisation's output, and the batch statistics when it computed them (fp32, untracked:
/// for running averages).
pub(crate) struct Normalised<B: Backend> {
    pub output: FloatTensor<B>,
    pub batch_stats: Option<(FloatTensor<B>, FloatTensor<B>)>,
}

/// The normalisation: `act((x - mean) / sqrt(var + eps) * gamma + beta)`, statistics per group
/// of `grouping` over `view`, in fp32 whatever `x`'s float type, output in `x`'s type.
#[allow(clippy::too_many_arguments)]
pub(crate) fn normalise<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    statistics: Statistics<B>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<B> {
    let norm = NormSpec {
        gamma,
        beta,
        statistics,
        view,
        grouping,
        act,
        epsilon,
    };
    let device = B::float_device(&x);
    let args = (x, norm.into_parts());
    match dispatch::run::<B, _, dispatch::OutParts<_>>(&device, <dyn Lean>::normalise, args) {
        Ok(out) => Normalised::from_parts(out),
        Err((x, norm)) => {
            let n = NormSpec::<B>::from_parts(norm);
            // Any other backend: tensor ops, differentiated by Burn if it is an autodiff one.
            composed::<B>(
                x,
                n.gamma,
                n.beta,
                n.statistics,
                n.view,
                n.grouping,
                n.act,
                n.epsilon,
            )
        }
    }
}

/// A ReLU that keeps its output for backward (Burn's keeps its input): the output is what the
/// next layer keeps anyway, so the ReLU itself costs no memory.
pub(crate) fn relu<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    dispatch::run::<B, _, _>(&B::float_device(&x), <dyn Lean>::relu, x).unwrap_or_else(B::relu)
}

/// `a + b` of equal shapes keeping nothing for backward under any checkpoint strategy (Burn's
/// `BalancedCheckpointing` would keep both inputs of its memory-bound add until backward).
pub(crate) fn add<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    if a.shape() != b.shape() {
        return B::float_add(a, b);
    }
    let device = B::float_device(&a);
    match dispatch::run::<B, _, _>(&device, <dyn Lean>::add, (a, b)) {
        Ok(out) => out,
        Err((a, b)) => B::float_add(a, b),
    }
}

/// `conv2d(x, weight, bias)` whose backward computes the weight gradient with
/// [`ConvKernels::conv2d_weight_grad`] (on Flex: contiguous, exactly the weight's size, without
/// the strided copies of Burn's default).
pub(crate) fn conv2d<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
) -> FloatTensor<B> {
    let conv = ConvSpec::<B> {
        weight,
        bias,
        options,
    };
    let device = B::float_device(&x);
    let args = (x, conv.into_parts());
    match dispatch::run::<B, _, _>(&device, <dyn Lean>::conv2d, args) {
        Ok(out) => out,
        Err((x, conv)) => {
            let c = ConvSpec::<B>::from_parts(conv);
            B::conv2d(x, c.weight, c.bias, c.options)
        }
    }
}

/// `x * weight + bias` for `x` `[N, in]`, whose weight gradient is added into the gradient the
/// weight has so far in place (the sums of earlier micro-batches under accumulation: no second
/// weight-sized buffer beside them).
pub(crate) fn linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let device = B::float_device(&x);
    match dispatch::run::<B, _, _>(&device, <dyn Lean>::linear, (x, weight, bias)) {
        Ok(out) => out,
        Err((x, weight, bias)) => B::linear(x, weight, bias),
    }
}

/// `max_pool2d(x)` that keeps only the maxima's indices and the input's shape for backward (on
/// `Autodiff<Flex>`, whose backward reads nothing else of the input).
pub(crate) fn max_pool2d<B: Backend>(
    x: FloatTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
) -> FloatTensor<B> {
    let pool = PoolSpec {
        kernel,
        stride,
        padding,
        dilation,
        ceil_mode,
    };
    let device = B::float_device(&x);
    match dispatch::run::<B, _, _>(&device, <dyn Lean>::max_pool2d, (x, pool)) {
        Ok(out) => out,
        Err((x, p)) => B::max_pool2d(x, p.kernel, p.stride, p.padding, p.dilation, p.ceil_mode),
    }
}

mod conv;
mod dispatch;
mod fused;
mod linear;
mod norm;
mod pool;
mod relu;
mod shared;

pub(crate) use fused::{ConvSpec, NormSpec};
pub(crate) use shared::PoolSpec;

pub use dispatch::{host_resident, is_lean, lean_backends, register_backend};

/// `B`'s own block-wise 8-bit quantization (`LeanBackend::quantize_blocks`), where it has one.
pub(crate) fn quantize_blocks<B: Backend>(
    x: FloatTensor<B>,
    map: Vec<f32>,
    block: usize,
) -> Option<(burn::tensor::ops::IntTensor<B>, FloatTensor<B>)> {
    let device = B::float_device(&x);
    dispatch::run::<B, _, Option<_>>(
        &device,
        |lean, call| lean.quantize_blocks(call),
        (x, map, block),
    )
    .ok()
    .flatten()
}

/// `B`'s own dequantization of [`quantize_blocks`]' output, where it has one.
pub(crate) fn dequantize_blocks<B: Backend>(
    codes: burn::tensor::ops::IntTensor<B>,
    absmax: FloatTensor<B>,
    map: Vec<f32>,
    block: usize,
) -> Option<FloatTensor<B>> {
    let device = B::float_device(&absmax);
    dispatch::run::<B, _, Option<_>>(
        &device,
        |lean, call| lean.dequantize_blocks(call),
        (codes, absmax, map, block),
    )
    .ok()
    .flatten()
}

use dispatch::Lean;
use norm::composed;

/// `conv2d(act(normalise(x)))` keeping only `x` (and the statistics) for backward: see
/// [`fused`]. On a backend without the fused op, the two ops as they are.
pub(crate) fn norm_act_conv<B: Backend>(
    x: FloatTensor<B>,
    norm: NormSpec<B>,
    conv: ConvSpec<B>,
) -> Normalised<B> {
    let device = B::float_device(&x);
    let args = (x, norm.into_parts(), conv.into_parts());
    let (x, norm, conv) = match dispatch::run::<B, _, _>(&device, <dyn Lean>::norm_act_conv, args) {
        Ok(out) => return Normalised::from_parts(out),
        Err((x, norm, conv)) => (
            x,
            NormSpec::<B>::from_parts(norm),
            ConvSpec::<B>::from_parts(conv),
        ),
    };
    let normalised = norm.normalise(x);
    Normalised {
        output: conv2d::<B>(normalised.output, conv.weight, conv.bias, conv.options),
        batch_stats: normalised.batch_stats,
    }
}

/// `act(normalise(conv2d(x)))` keeping only `x` (and the statistics) for backward, the
/// convolution's output recomputed in backward: see [`shared`]. `norm.view` is that of the
/// convolution's output. On a backend without the op, the two ops as they are.
pub(crate) fn conv_norm<B: Backend>(
    x: FloatTensor<B>,
    conv: ConvSpec<B>,
    norm: NormSpec<B>,
) -> Normalised<B> {
    let device = B::float_device(&x);
    let args = (x, conv.into_parts(), norm.into_parts());
    let (x, conv, norm) = match dispatch::run::<B, _, _>(&device, <dyn Lean>::conv_norm, args) {
        Ok(out) => return Normalised::from_parts(out),
        Err((x, conv, norm)) => (
            x,
            ConvSpec::<B>::from_parts(conv),
            NormSpec::<B>::from_parts(norm),
        ),
    };
    let y = conv2d::<B>(x, conv.weight, conv.bias, conv.options);
    norm.normalise(y)
}

/// `max_pool2d(act(normalise(x)))` keeping only `x` (and the statistics) for backward, the
/// activation's output and the maxima's indices recomputed in backward: see [`shared`]. On a
/// backend without the op, the two ops as they are.
pub(crate) fn norm_act_pool<B: Backend>(
    x: FloatTensor<B>,
    norm: NormSpec<B>,
    pool: PoolSpec,
) -> Normalised<B> {
    let device = B::float_device(&x);
    let args = (x, norm.into_parts(), pool);
    let (x, norm, pool) = match dispatch::run::<B, _, _>(&device, <dyn Lean>::norm_act_pool, args) {
        Ok(out) => return Normalised::from_parts(out),
        Err((x, norm, pool)) => (x, NormSpec::<B>::from_parts(norm), pool),
    };
    let normalised = norm.normalise(x);
    Normalised {
        output: max_pool2d::<B>(
            normalised.output,
            pool.kernel,
            pool.stride,
            pool.padding,
            pool.dilation,
            pool.ceil_mode,
        ),
        batch_stats: normalised.batch_stats,
    }
}

impl<K: Backend> Statistics<Autodiff<K>> {
    /// The same statistics on the inner backend.
    fn inner(self) -> Statistics<K> {
        let inner = |t: FloatTensor<Autodiff<K>>| <Autodiff<K> as AutodiffBackend>::inner(t);
        match self {
            Statistics::Batch => Statistics::Batch,
            Statistics::Recorded { mean, var } => Statistics::Recorded {
                mean: inner(mean),
                var: inner(var),
            },
            Statistics::Running { mean, var } => Statistics::Running {
                mean: inner(mean),
                var: inner(var),
            },
        }
    }
}

impl<K: NormKernels> Statistics<K> {
    /// Mean and biased variance to normalise `x` with, and whether they are the batch's
    /// (gradients flow through them).
    fn of(
        self,
        x: &FloatTensor<K>,
        view: View,
        grouping: Grouping,
    ) -> (FloatTensor<K>, FloatTensor<K>, bool) {
        match self {
            Statistics::Batch => {
                let (mean, var) = K::norm_stats(x, view, grouping);
                (mean, var, true)
            }
            Statistics::Recorded { mean, var } => (mean, var, true),
            Statistics::Running { mean, var } => (mean, var, false),
        }
    }
}

impl<B: Backend> NormSpec<B> {
    /// [`normalise`] of `x` with these parameters.
    fn normalise(self, x: FloatTensor<B>) -> Normalised<B> {
        normalise::<B>(
            x,
            self.gamma,
            self.beta,
            self.statistics,
            self.view,
            self.grouping,
            self.act,
            self.epsilon,
        )
    }
}
