//! The arithmetic of memsave's normalisation layers, on an inner (non-autodiff) backend.
//!
//! Every normalisation here is one pattern: statistics (mean and variance, in fp32) over the
//! elements of a *group*, then `y = act(x * scale + shift)` with a scale and shift per *channel*,
//! and a backward that needs only `x`, the statistics and the affine parameters. The layout is
//! `[outer, channels, inner]` (contiguous), and a group is what the statistics are taken over:
//!
//! | layer | view of the input | one group | channel of the affine |
//! |---|---|---|---|
//! | BatchNorm | `[N, C, S]` | one `c`, all `n` and `s` | `c` |
//! | GroupNorm | `[N, C, S]` | one `n` and one group of `C / G` channels, all `s` | `c` |
//! | LayerNorm | `[R, 1, F]` | one row `r`, all `f` | `f` (per element) |
//!
//! [`NormKernels`] runs it: Flex with fused loops over raw slices on rayon's pool (one pass for
//! the statistics, one for the output; two for the backward, with no activation-sized
//! temporary), every other backend with tensor ops ([`generic`]). Inputs may be fp32, f16 or
//! bf16; statistics and parameters are fp32; outputs and input gradients take the input's
//! dtype.

mod conv;
mod flex;
pub mod generic;

use burn::prelude::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, ModuleOps};

/// The activation fused after the affine transform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// None: `y = x * scale + shift`.
    Identity,
    /// `max(0, .)`; its backward mask is recomputed from the input, so nothing more is kept.
    Relu,
}

/// How a normalisation groups its input (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grouping {
    /// Statistics per channel over the batch and the positions (BatchNorm).
    PerChannel,
    /// Statistics per sample and group of `channels / groups` channels (GroupNorm).
    PerSampleGroup {
        /// Number of groups; divides the channels.
        groups: usize,
    },
    /// Statistics per row over the last dimension, affine per element of it (LayerNorm); the
    /// view is `[rows, 1, features]` with the affine indexed by feature.
    PerRow,
}

/// The shape of a normalisation's input as `[outer, channels, inner]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// `N` (or the rows of a LayerNorm).
    pub outer: usize,
    /// `C` (1 for a LayerNorm).
    pub channels: usize,
    /// The positions per channel (the features of a LayerNorm).
    pub inner: usize,
}

impl View {
    /// Number of groups the statistics are taken over.
    pub fn groups(&self, grouping: Grouping) -> usize {
        match grouping {
            Grouping::PerChannel => self.channels,
            Grouping::PerSampleGroup { groups } => self.outer * groups,
            Grouping::PerRow => self.outer,
        }
    }

    /// Elements per group.
    pub fn group_size(&self, grouping: Grouping) -> usize {
        match grouping {
            Grouping::PerChannel => self.outer * self.inner,
            Grouping::PerSampleGroup { groups } => self.channels / groups * self.inner,
            Grouping::PerRow => self.inner,
        }
    }

    /// Number of affine parameters.
    pub fn affine(&self, grouping: Grouping) -> usize {
        match grouping {
            Grouping::PerRow => self.inner,
            _ => self.channels,
        }
    }
}

/// What [`NormKernels::norm_backward`] must compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// The input's gradient.
    pub input: bool,
    /// The affine parameters' gradients.
    pub affine: bool,
    /// Whether the statistics came from this batch (training), so that they depend on the
    /// input; otherwise (running statistics) they are constants.
    pub batch_stats: bool,
}

/// The normalisation kernels of a backend.
pub trait NormKernels: Backend {
    /// Mean and biased variance per group, fp32 `[groups]`.
    fn norm_stats(
        x: &FloatTensor<Self>,
        view: View,
        grouping: Grouping,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `act((x - mean) * invstd * gamma + beta)`, in `x`'s dtype. `mean` and `invstd` are per
    /// group, `gamma` and `beta` per affine element (fp32).
    #[allow(clippy::too_many_arguments)]
    fn norm_apply(
        x: FloatTensor<Self>,
        view: View,
        grouping: Grouping,
        mean: &FloatTensor<Self>,
        invstd: &FloatTensor<Self>,
        gamma: &FloatTensor<Self>,
        beta: &FloatTensor<Self>,
        act: Act,
    ) -> FloatTensor<Self>;

    /// Gradients of [`NormKernels::norm_apply`] with batch statistics: `(dx, dgamma, dbeta)`.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        x: &FloatTensor<Self>,
        dy: FloatTensor<Self>,
        view: View,
        grouping: Grouping,
        mean: &FloatTensor<Self>,
        invstd: &FloatTensor<Self>,
        gamma: &FloatTensor<Self>,
        beta: &FloatTensor<Self>,
        act: Act,
        wanted: Wanted,
    ) -> (
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
    );
}

impl NormKernels for burn::backend::Flex {
    fn norm_stats(
        x: &FloatTensor<Self>,
        view: View,
        grouping: Grouping,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::stats(x, view, grouping)
    }

    fn norm_apply(
        x: FloatTensor<Self>,
        view: View,
        grouping: Grouping,
        mean: &FloatTensor<Self>,
        invstd: &FloatTensor<Self>,
        gamma: &FloatTensor<Self>,
        beta: &FloatTensor<Self>,
        act: Act,
    ) -> FloatTensor<Self> {
        flex::apply(x, view, grouping, mean, invstd, gamma, beta, act)
    }

    fn norm_backward(
        x: &FloatTensor<Self>,
        dy: FloatTensor<Self>,
        view: View,
        grouping: Grouping,
        mean: &FloatTensor<Self>,
        invstd: &FloatTensor<Self>,
        gamma: &FloatTensor<Self>,
        beta: &FloatTensor<Self>,
        act: Act,
        wanted: Wanted,
    ) -> (
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
    ) {
        flex::backward(
            x, dy, view, grouping, mean, invstd, gamma, beta, act, wanted,
        )
    }
}

/// Backends whose kernels are the tensor-op versions of [`generic`].
#[allow(unused_macros)]
macro_rules! generic_kernels {
    ($($backend:ty),*) => {$(
        impl NormKernels for $backend {
            fn norm_stats(
                x: &FloatTensor<Self>,
                view: View,
                grouping: Grouping,
            ) -> (FloatTensor<Self>, FloatTensor<Self>) {
                generic::stats::<Self>(x, view, grouping)
            }

            fn norm_apply(
                x: FloatTensor<Self>,
                view: View,
                grouping: Grouping,
                mean: &FloatTensor<Self>,
                invstd: &FloatTensor<Self>,
                gamma: &FloatTensor<Self>,
                beta: &FloatTensor<Self>,
                act: Act,
            ) -> FloatTensor<Self> {
                generic::apply::<Self>(x, view, grouping, mean, invstd, gamma, beta, act)
            }

            fn norm_backward(
                x: &FloatTensor<Self>,
                dy: FloatTensor<Self>,
                view: View,
                grouping: Grouping,
                mean: &FloatTensor<Self>,
                invstd: &FloatTensor<Self>,
                gamma: &FloatTensor<Self>,
                beta: &FloatTensor<Self>,
                act: Act,
                wanted: Wanted,
            ) -> (
                Option<FloatTensor<Self>>,
                Option<FloatTensor<Self>>,
                Option<FloatTensor<Self>>,
            ) {
                generic::backward::<Self>(
                    x, dy, view, grouping, mean, invstd, gamma, beta, act, wanted,
                )
            }
        }
    )*};
}

#[cfg(feature = "cuda")]
generic_kernels!(burn::backend::Cuda);

/// The convolution kernels memsave replaces where the backend's default is slow.
pub trait ConvKernels: Backend {
    /// The gradient of `conv2d(x, weight)` with respect to `weight`, contiguous and of the
    /// weight's shape. Default: the backend's own.
    fn conv2d_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_weight_backward(x, weight, dy, options)
    }
}

impl ConvKernels for burn::backend::Flex {
    fn conv2d_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        if !conv::supports(&options) {
            return Self::conv2d_weight_backward(x, weight, dy, options);
        }
        let shape = weight.layout().shape().to_vec();
        conv::weight_grad(
            &x,
            &dy,
            [shape[0], shape[1], shape[2], shape[3]],
            weight.dtype(),
            &options,
        )
    }
}

#[cfg(feature = "cuda")]
impl ConvKernels for burn::backend::Cuda {}
