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
//! The ops run on `Autodiff<Flex>` (fused loops, [`super::kernels`]) and `Autodiff<Cuda>`
//! (tensor ops), found at run time from the tensor's type so that layers stay generic over any
//! `B: Backend`; on any other backend the same arithmetic runs as tensor ops that Burn's autodiff
//! differentiates.

use std::any::{Any, TypeId};

use burn::backend::{Autodiff, Flex};
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
    macro_rules! on {
        ($backend:ty, $run:ident, $kernels:ty) => {
            if same::<B, $backend>() {
                let out = $run::<$kernels>(
                    retype(x),
                    retype(gamma),
                    retype(beta),
                    statistics.retype(),
                    view,
                    grouping,
                    act,
                    epsilon,
                );
                return out.retype();
            }
        };
    }
    on!(Autodiff<Flex>, tracked, Flex);
    on!(Flex, untracked, Flex);
    #[cfg(feature = "cuda")]
    {
        on!(Autodiff<burn::backend::Cuda>, tracked, burn::backend::Cuda);
        on!(burn::backend::Cuda, untracked, burn::backend::Cuda);
    }
    // Any other backend: tensor ops, differentiated by Burn if it is an autodiff backend.
    composed::<B>(x, gamma, beta, statistics, view, grouping, act, epsilon)
}

/// A ReLU that keeps its output for backward (Burn's keeps its input): the output is what the
/// next layer keeps anyway, so the ReLU itself costs no memory.
pub(crate) fn relu<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    if same::<B, Autodiff<Flex>>() {
        return retype(relu_keeping_output::<Flex>(retype(x)));
    }
    #[cfg(feature = "cuda")]
    if same::<B, Autodiff<burn::backend::Cuda>>() {
        return retype(relu_keeping_output::<burn::backend::Cuda>(retype(x)));
    }
    B::relu(x)
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
    if same::<B, Autodiff<Flex>>() {
        return retype(tracked_conv2d::<Flex>(
            retype(x),
            retype(weight),
            bias.map(retype),
            options,
        ));
    }
    #[cfg(feature = "cuda")]
    if same::<B, Autodiff<burn::backend::Cuda>>() {
        return retype(tracked_conv2d::<burn::backend::Cuda>(
            retype(x),
            retype(weight),
            bias.map(retype),
            options,
        ));
    }
    B::conv2d(x, weight, bias, options)
}

/// `x * weight + bias` for `x` `[N, in]`, whose weight gradient is added into the gradient the
/// weight has so far in place (the sums of earlier micro-batches under accumulation: no second
/// weight-sized buffer beside them).
pub(crate) fn linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    macro_rules! on {
        ($inner:ty) => {
            if same::<B, Autodiff<$inner>>() {
                return retype(tracked_linear::<$inner>(
                    retype(x),
                    retype(weight),
                    bias.map(retype),
                ));
            }
        };
    }
    on!(Flex);
    #[cfg(feature = "cuda")]
    on!(burn::backend::Cuda);
    B::linear(x, weight, bias)
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
    if same::<B, Autodiff<Flex>>() {
        let options = PoolOptions {
            kernel,
            stride,
            padding,
            dilation,
            ceil_mode,
        };
        return retype(tracked_max_pool2d(retype(x), options));
    }
    B::max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
}

mod conv;
mod fused;
mod linear;
mod norm;
mod pool;
mod relu;
mod shared;

pub(crate) use fused::{ConvSpec, NormSpec};
pub(crate) use shared::PoolSpec;

use conv::tracked_conv2d;
use fused::tracked_norm_act_conv;
use linear::tracked_linear;
use norm::{composed, tracked, untracked};
use pool::{tracked_max_pool2d, PoolOptions};
use relu::relu_keeping_output;
use shared::{tracked_conv_norm, tracked_norm_act_pool};

/// `conv2d(act(normalise(x)))` keeping only `x` (and the statistics) for backward: see
/// [`fused`]. On a backend without the fused op, the two ops as they are.
pub(crate) fn norm_act_conv<B: Backend>(
    x: FloatTensor<B>,
    norm: NormSpec<B>,
    conv: ConvSpec<B>,
) -> Normalised<B> {
    if same::<B, Autodiff<Flex>>() {
        let out = tracked_norm_act_conv::<Flex>(retype(x), norm.retype(), conv.retype());
        return out.retype();
    }
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
    macro_rules! on {
        ($inner:ty) => {
            if same::<B, Autodiff<$inner>>() {
                let out = tracked_conv_norm::<$inner>(retype(x), conv.retype(), norm.retype());
                return out.retype();
            }
        };
    }
    on!(Flex);
    #[cfg(feature = "cuda")]
    on!(burn::backend::Cuda);
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
    macro_rules! on {
        ($inner:ty) => {
            if same::<B, Autodiff<$inner>>() {
                let out = tracked_norm_act_pool::<$inner>(retype(x), norm.retype(), pool);
                return out.retype();
            }
        };
    }
    on!(Flex);
    #[cfg(feature = "cuda")]
    on!(burn::backend::Cuda);
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

impl<B: Backend> Statistics<B> {
    /// The same statistics as tensors of `T` (after [`same`] said the types are one).
    fn retype<T: Backend>(self) -> Statistics<T> {
        match self {
            Statistics::Batch => Statistics::Batch,
            Statistics::Recorded { mean, var } => Statistics::Recorded {
                mean: retype(mean),
                var: retype(var),
            },
            Statistics::Running { mean, var } => Statistics::Running {
                mean: retype(mean),
                var: retype(var),
            },
        }
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

    fn retype<T: Backend>(self) -> NormSpec<T> {
        NormSpec {
            gamma: retype(self.gamma),
            beta: retype(self.beta),
            statistics: self.statistics.retype(),
            view: self.view,
            grouping: self.grouping,
            act: self.act,
            epsilon: self.epsilon,
        }
    }
}

impl<B: Backend> ConvSpec<B> {
    fn retype<T: Backend>(self) -> ConvSpec<T> {
        ConvSpec {
            weight: retype(self.weight),
            bias: self.bias.map(retype),
            options: self.options,
        }
    }
}

impl<B: Backend> Normalised<B> {
    fn retype<T: Backend>(self) -> Normalised<T> {
        Normalised {
            output: retype(self.output),
            batch_stats: self.batch_stats.map(|(m, v)| (retype(m), retype(v))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch on the backend's type.

/// Whether `B` and `T` have the same float tensors (`Autodiff<K, C>` for any strategy `C` is
/// `Autodiff<K>` here: the strategy only matters to memory-bound ops, and these are not).
fn same<B: Backend, T: Backend>() -> bool {
    TypeId::of::<FloatTensor<B>>() == TypeId::of::<FloatTensor<T>>()
}

/// A tensor of `F` as one of `T`, after [`same`] said they are one type.
fn retype<F: 'static, T: 'static>(value: F) -> T {
    let boxed: Box<dyn Any> = Box::new(value);
    *boxed
        .downcast::<T>()
        .ok()
        .expect("`same` checked that the types are equal")
}
