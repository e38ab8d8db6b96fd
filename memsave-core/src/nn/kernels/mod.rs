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
mod im2col;
mod linear;

use burn::prelude::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps, ModuleOps};
use burn::tensor::DType;

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
    ([$($generics:tt)*] $backend:ty) => {
        impl<$($generics)*> NormKernels for $backend {
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

        impl<$($generics)*> ConvKernels for $backend {}

        impl<$($generics)*> LeanBackend for $backend {}
    };
}

// Every CubeCL runtime (CUDA, wgpu: Vulkan, Metal, DX12, WebGPU; ROCm/HIP) through one
// implementation, with and without Burn's fusion.
#[cfg(feature = "cubecl")]
generic_kernels!(
    [R: burn_cubecl::CubeRuntime, F: burn_cubecl::FloatElement, I: burn_cubecl::IntElement, BT: burn_cubecl::BoolElement]
    burn_cubecl::CubeBackend<R, F, I, BT>
);
#[cfg(feature = "fusion")]
generic_kernels!([B: burn_fusion::FusionBackend] burn_fusion::Fusion<B>);

/// The convolution kernels memsave replaces where the backend's default is slow.
pub trait ConvKernels: Backend {
    /// `conv2d(x, weight) + bias`. Default: the backend's own.
    fn conv2d_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d(x, weight, bias, options)
    }

    /// The gradient of `conv2d(x, weight)` with respect to `x`. Default: the backend's own.
    fn conv2d_input_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_x_backward(x, weight, dy, options)
    }

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

    /// `onto + conv2d_weight_grad(x, weight, dy)`, where `onto` is the gradient the weight has
    /// so far (as [`burn::backend::autodiff::grads::Gradients::register`] adds). Default:
    /// exactly that sum; on Flex, added into `onto` in place where it can be.
    fn conv2d_weight_grad_onto(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
        onto: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_add(Self::conv2d_weight_grad(x, weight, dy, options), onto)
    }

    /// `onto + x^T * dy` (or `x^T * dy` without `onto`): the weight gradient of a linear layer
    /// `y = x * W`, x `[N, in]`, dy `[N, out]`. Default: tensor ops; on Flex, fp32, added into
    /// `onto` in place where it can be.
    fn linear_weight_grad_onto(
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        onto: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        linear_weight_grad_ops::<Self>(x, dy, onto)
    }
}

/// A backend memsave's lean autodiff ops run on (the norms and their fused forms, the ReLU
/// keeping its output, the convolution and linear layer adding their weight gradient in place,
/// the max pool keeping only its indices): the device extension point. Implemented for Flex
/// (fused loops) and, once, for every CubeCL backend (`CubeBackend<R, ..>`, and
/// `Fusion<CubeBackend<R, ..>>` with the `fusion` feature): CUDA, wgpu (Vulkan, Metal, DX12,
/// WebGPU) and ROCm/HIP share the tensor-op implementation of [`generic`].
///
/// Layers stay generic over any `B: Backend`: they find a backend's lean ops at run time
/// (`memsave::nn::lean_backends`); Burn's own backends are registered when their feature is
/// on, and another backend that implements this trait is registered with
/// `memsave::nn::register_backend`.
pub trait LeanBackend: NormKernels + ConvKernels {
    /// Whether the backend's tensors live in the host's memory (a CPU backend: Flex), so that
    /// staging them to the host (activation offload, `crate::checkpoint::offload`) frees nothing.
    /// Default: `false`, a device with memory of its own (CUDA, wgpu).
    fn host_resident() -> bool {
        false
    }

    /// The gradient of `max_pool2d_with_indices(x)` with respect to `x`, from the maxima's
    /// indices and `x`'s shape and dtype alone. Default: the backend's own backward with a
    /// broadcast zero standing in for `x` (Flex and CubeCL read only its shape).
    #[allow(clippy::too_many_arguments)]
    fn max_pool2d_input_grad(
        shape: burn::tensor::Shape,
        dtype: DType,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
        grad: FloatTensor<Self>,
        indices: burn::tensor::ops::IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let device = Self::float_device(&grad);
        let zero = Self::float_zeros(
            burn::tensor::Shape::new([1, 1, 1, 1]),
            &device,
            dtype.into(),
        );
        let stand_in = Self::float_expand(zero, shape);
        Self::max_pool2d_with_indices_backward(
            stand_in, kernel, stride, padding, dilation, ceil_mode, grad, indices,
        )
        .x_grad
    }

    /// Block-wise 8-bit quantization (`crate::train::quant`): `x` (fp32, its length a
    /// multiple of `block`) as the codes (`u8`) of the nearest values of the sorted `map` (256
    /// values) to each value over its block's largest magnitude, and those magnitudes (at least
    /// 1e-12). `None`: the caller's tensor ops do it (the default).
    fn quantize_blocks(
        _x: &FloatTensor<Self>,
        _map: &[f32],
        _block: usize,
    ) -> Option<(burn::tensor::ops::IntTensor<Self>, FloatTensor<Self>)> {
        None
    }

    /// The fp32 values of [`LeanBackend::quantize_blocks`]' `codes` and `absmax`
    /// (`map[code] * absmax` of its block). `None`: the caller's tensor ops (the default).
    fn dequantize_blocks(
        _codes: &burn::tensor::ops::IntTensor<Self>,
        _absmax: &FloatTensor<Self>,
        _map: &[f32],
        _block: usize,
    ) -> Option<FloatTensor<Self>> {
        None
    }
}

impl LeanBackend for burn::backend::Flex {
    fn host_resident() -> bool {
        true
    }

    fn dequantize_blocks(
        codes: &burn::tensor::ops::IntTensor<Self>,
        absmax: &FloatTensor<Self>,
        map: &[f32],
        block: usize,
    ) -> Option<FloatTensor<Self>> {
        flex::dequantize_blocks(codes, absmax, map, block)
    }

    fn quantize_blocks(
        x: &FloatTensor<Self>,
        map: &[f32],
        block: usize,
    ) -> Option<(burn::tensor::ops::IntTensor<Self>, FloatTensor<Self>)> {
        flex::quantize_blocks(x, map, block)
    }
}

/// `onto + x^T * dy` as tensor ops (see [`ConvKernels::linear_weight_grad_onto`]).
fn linear_weight_grad_ops<B: Backend>(
    x: FloatTensor<B>,
    dy: FloatTensor<B>,
    onto: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let dw = B::float_matmul(B::float_transpose(x), dy);
    match onto {
        Some(onto) => B::float_add(dw, onto),
        None => dw,
    }
}

/// On Flex, fp32 convolutions with one group run memsave's kernels (`conv`); the others
/// Flex's own (the weight gradient: memsave's for any float type).
impl ConvKernels for burn::backend::Flex {
    fn conv2d_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        if !conv::supports_f32(&x, &weight, &options) {
            return Self::conv2d(x, weight, bias, options);
        }
        conv::forward(&x, &weight, bias.as_ref(), &options)
    }

    fn conv2d_input_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        if !conv::supports_f32(&x, &weight, &options) || dy.dtype() != DType::F32 {
            return Self::conv2d_x_backward(x, weight, dy, options);
        }
        conv::input_grad(x.layout().shape(), &weight, &dy, &options)
    }

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

    fn conv2d_weight_grad_onto(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
        onto: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if !conv::supports(&options) {
            let dw = Self::conv2d_weight_backward(x, weight, dy, options);
            return Self::float_add(dw, onto);
        }
        let shape = weight.layout().shape().to_vec();
        let shape = [shape[0], shape[1], shape[2], shape[3]];
        match conv::weight_grad_onto(&x, &dy, shape, weight.dtype(), &options, onto) {
            Ok(sum) => sum,
            Err((dw, onto)) => Self::float_add(dw, onto),
        }
    }

    fn linear_weight_grad_onto(
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        onto: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 || dy.dtype() != DType::F32 {
            return linear_weight_grad_ops::<Self>(x, dy, onto);
        }
        match linear::linear_weight_grad_onto(&x, &dy, onto) {
            Ok(sum) => sum,
            Err((dw, Some(onto))) => Self::float_add(dw, onto),
            Err((dw, None)) => dw,
        }
    }
}
