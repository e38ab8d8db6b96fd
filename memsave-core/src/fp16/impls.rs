//! [`Fp16Module`] for plain values, containers, parameters and the layers of `burn::nn`.

use crate::fp16::PrecisionExt;
use burn::module::Param;
use burn::nn;
use burn::prelude::Backend;
use burn::tensor::{BasicOps, Bool, DType, Int, Tensor};

use super::{cast_leaf, cast_params, Fp16, Fp16Module, Precision};
use crate::cast::cast_tensor_type;

/// Values with nothing to cast and no flag: left as they are.
macro_rules! unchanged {
    ($($ty:ty),* $(,)?) => {$(
        impl Fp16Module for $ty {
            fn wrap_fp16(self, _precision: Precision) -> Self {
                self
            }
        }
    )*};
}

unchanged!(
    bool,
    u8,
    u16,
    u32,
    u64,
    usize,
    i8,
    i16,
    i32,
    i64,
    isize,
    f32,
    f64,
    String,
    nn::PaddingConfig1d,
    nn::PaddingConfig2d,
    nn::PaddingConfig3d,
    // Layers without parameters that are safe in half precision: they compute in the dtype of
    // their input. (Softplus is not: `exp(x)` overflows f16 from x = 11; see `Fp32`.)
    nn::Relu,
    nn::Gelu,
    nn::Sigmoid,
    nn::Tanh,
    nn::LeakyRelu,
    nn::HardSigmoid,
    nn::activation::HardSwish,
    nn::Celu,
    nn::Elu,
    nn::Selu,
    nn::GLU,
    nn::Softsign,
    nn::ThresholdedRelu,
    nn::HardShrink,
    nn::SoftShrink,
    nn::Shrink,
    // Its mask follows the input's dtype.
    nn::Dropout,
    nn::Unfold4d,
    nn::pool::MaxPool1d,
    nn::pool::MaxPool2d,
    nn::pool::AvgPool1d,
    nn::pool::AvgPool2d,
    nn::pool::AdaptiveAvgPool1d,
    nn::pool::AdaptiveAvgPool2d,
    nn::interpolate::Interpolate1d,
    nn::interpolate::Interpolate2d,
    // Losses without tensors: MMCV calls them from `force_fp32` methods, in fp32.
    nn::loss::MseLoss,
    nn::loss::LpLoss,
    nn::loss::HuberLoss,
    nn::loss::CosineEmbeddingLoss,
    nn::loss::SmoothL1Loss,
    nn::loss::KLDivLoss,
    nn::loss::PoissonNllLoss,
    nn::loss::CTCLoss,
    nn::loss::RNNTLoss,
);

/// A field that is itself a flag but not the module's own `fp16_enabled` is left alone.
impl Fp16Module for Fp16 {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

/// Burn treats a bare tensor field as a constant, not a parameter: it is not cast.
impl<B: Backend, const D: usize, K: BasicOps<B>> Fp16Module for Tensor<B, D, K> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

/// A float parameter held directly by a model is cast to half, as `model.half()` would.
impl<B: Backend, const D: usize> Fp16Module for Param<Tensor<B, D>> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        self.map(|tensor| cast_leaf(tensor, DType::F32, precision.dtype()))
    }
}

impl<B: Backend, const D: usize> Fp16Module for Param<Tensor<B, D, Int>> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl<B: Backend, const D: usize> Fp16Module for Param<Tensor<B, D, Bool>> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl<T: Fp16Module> Fp16Module for Option<T> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        self.map(|module| module.wrap_fp16(precision))
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::id::SegmentId, bool)) {
        for module in self.iter() {
            module.visit_with_cp_flags(visit);
        }
    }
}

impl<T: Fp16Module> Fp16Module for Box<T> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Box::new((*self).wrap_fp16(precision))
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::id::SegmentId, bool)) {
        (**self).visit_with_cp_flags(visit);
    }
}

impl<T: Fp16Module> Fp16Module for Vec<T> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        self.into_iter()
            .map(|module| module.wrap_fp16(precision))
            .collect()
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::id::SegmentId, bool)) {
        for module in self.iter() {
            module.visit_with_cp_flags(visit);
        }
    }
}

impl<T: Fp16Module, const N: usize> Fp16Module for [T; N] {
    fn wrap_fp16(self, precision: Precision) -> Self {
        self.map(|module| module.wrap_fp16(precision))
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::id::SegmentId, bool)) {
        for module in self.iter() {
            module.visit_with_cp_flags(visit);
        }
    }
}

macro_rules! tuple {
    ($($name:ident)+) => {
        impl<$($name: Fp16Module),+> Fp16Module for ($($name,)+) {
            #[allow(non_snake_case)]
            fn wrap_fp16(self, precision: Precision) -> Self {
                let ($($name,)+) = self;
                ($($name.wrap_fp16(precision),)+)
            }

            #[allow(non_snake_case)]
            fn visit_with_cp_flags(
                &self,
                visit: &mut dyn FnMut(crate::checkpoint::id::SegmentId, bool),
            ) {
                let ($($name,)+) = self;
                $($name.visit_with_cp_flags(visit);)+
            }
        }
    };
}

tuple!(A);
tuple!(A B);
tuple!(A B C);
tuple!(A B C D);

/// Layers of `burn::nn` with parameters that run in half precision: every float parameter is
/// cast (MMCV's `model.half()`). The normalisations are not among them: see [`super::Fp32`].
macro_rules! half_layer {
    ($($ty:ident)::+) => {
        impl<B: Backend> Fp16Module for $($ty)::+<B> {
            fn wrap_fp16(self, precision: Precision) -> Self {
                cast_params(self, precision)
            }
        }
    };
}

half_layer!(nn::Linear);
half_layer!(nn::Embedding);
half_layer!(nn::PRelu);
half_layer!(nn::SwiGlu);
half_layer!(nn::activation::Activation);
half_layer!(nn::conv::Conv1d);
half_layer!(nn::conv::Conv2d);
half_layer!(nn::conv::Conv3d);
half_layer!(nn::conv::ConvTranspose1d);
half_layer!(nn::conv::ConvTranspose2d);
half_layer!(nn::conv::ConvTranspose3d);
half_layer!(nn::GateController);
// Attention: Burn's softmax subtracts the row maximum and the mask fill (-1e4) fits f16.
half_layer!(nn::attention::MultiHeadAttention);
// Not here, because they make fp32 tensors of their own that then meet half ones (a dtype
// mismatch): the RNNs (their zero initial state), CrossAttention, DeformConv2d, RotaryEncoding
// and GaussianNoise (its noise). They run as fp32 islands (`Fp32`).
half_layer!(nn::transformer::PositionWiseFeedForward);
// RmsNorm computes its root mean square in fp32 itself (Burn 0.21), so it is safe in half.
half_layer!(nn::RmsNorm);

/// The sinusoids are a constant (not a parameter): cast so that `input + sinusoids` meets one
/// dtype.
impl<B: Backend> Fp16Module for nn::PositionalEncoding<B> {
    fn wrap_fp16(mut self, precision: Precision) -> Self {
        self.sinusoids = cast_tensor_type(self.sinusoids, DType::F32, precision.dtype());
        self
    }
}

/// Losses that hold class weights: the weights stay fp32, for a loss computed in fp32 (called
/// from a `#[force_fp32]` method, as MMCV's heads do).
impl<B: Backend> Fp16Module for nn::loss::CrossEntropyLoss<B> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl<B: Backend> Fp16Module for nn::loss::BinaryCrossEntropyLoss<B> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}
