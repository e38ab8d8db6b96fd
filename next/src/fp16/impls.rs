//! [`Fp16Module`] for plain values, containers, parameters and the layers of `burn::nn`.

use crate::fp16::PrecisionExt;
use burn::module::Param;
use burn::nn;
use burn::tensor::{Bool, DType, Int, Tensor};

use super::{cast_params, Fp16, Fp16Module, Precision};
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
    // their input, and make no tensor of their own in the device's default dtype.
    nn::Identity,
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
    // Burn 0.22 caps its threshold at the largest argument `exp` takes in the input's dtype
    // (11 in f16), so it no longer overflows.
    nn::Softplus,
    nn::activation::Hardtanh,
    nn::activation::LogSigmoid,
    nn::activation::Mish,
    nn::activation::Relu6,
    nn::activation::SiLU,
    nn::activation::Tanhshrink,
    nn::activation::Threshold,
    // Their draws follow the input's dtype (`random_like`).
    nn::Dropout,
    nn::activation::RRelu,
    nn::Unfold4d,
    nn::Fold4d,
    nn::PixelShuffle,
    nn::PixelUnshuffle,
    nn::pool::MaxPool1d,
    nn::pool::MaxPool2d,
    nn::pool::AvgPool1d,
    nn::pool::AvgPool2d,
    nn::pool::AdaptiveAvgPool1d,
    nn::pool::AdaptiveAvgPool2d,
    nn::pool::AdaptiveAvgPool3d,
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
    nn::loss::GaussianNLLLoss,
    nn::loss::HingeEmbeddingLoss,
    nn::loss::MarginRankingLoss,
    nn::loss::MultiMarginLoss,
    nn::loss::SoftMarginLoss,
    nn::loss::TripletMarginLoss,
);

/// A field that is itself a flag but not the module's own `fp16_enabled` is left alone.
impl Fp16Module for Fp16 {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

/// Burn treats a bare tensor field as a constant, not a parameter: it is not cast.
impl<const D: usize> Fp16Module for Tensor<D> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl<const D: usize> Fp16Module for Tensor<D, Int> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl<const D: usize> Fp16Module for Tensor<D, Bool> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

/// A float parameter held directly by a model is cast to half, as `model.half()` would.
/// Through Burn's module map, which keeps an attached reparameterization (a LoRA adapter).
impl<const D: usize> Fp16Module for Param<Tensor<D>> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        cast_params(self, precision)
    }
}

impl<const D: usize> Fp16Module for Param<Tensor<D, Int>> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl<const D: usize> Fp16Module for Param<Tensor<D, Bool>> {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl<T: Fp16Module> Fp16Module for Option<T> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        self.map(|module| module.wrap_fp16(precision))
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::SegmentId, bool)) {
        for module in self.iter() {
            module.visit_with_cp_flags(visit);
        }
    }
}

impl<T: Fp16Module> Fp16Module for Box<T> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Box::new((*self).wrap_fp16(precision))
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::SegmentId, bool)) {
        (**self).visit_with_cp_flags(visit);
    }
}

impl<T: Fp16Module> Fp16Module for Vec<T> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        self.into_iter()
            .map(|module| module.wrap_fp16(precision))
            .collect()
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::SegmentId, bool)) {
        for module in self.iter() {
            module.visit_with_cp_flags(visit);
        }
    }
}

impl<T: Fp16Module, const N: usize> Fp16Module for [T; N] {
    fn wrap_fp16(self, precision: Precision) -> Self {
        self.map(|module| module.wrap_fp16(precision))
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::SegmentId, bool)) {
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
                visit: &mut dyn FnMut(crate::checkpoint::SegmentId, bool),
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
/// cast (MMCV's `model.half()`). Burn's `BatchNorm` and `LocalResponseNorm` are not among them:
/// see [`super::Fp32`].
macro_rules! half_layer {
    ($($ty:ident)::+) => {
        impl Fp16Module for $($ty)::+ {
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
// RmsNorm computes its root mean square in fp32 itself; its gamma meets the input's dtype.
half_layer!(nn::RmsNorm);
// Burn 0.22 computes the statistics of an f16 input in fp32 (`accumulation_dtype`), then runs
// the affine step in the input's dtype: gamma and beta must be half. bf16 has fp32's range, so
// its statistics cannot overflow (Burn computes them in bf16).
half_layer!(nn::LayerNorm);
half_layer!(nn::GroupNorm);
half_layer!(nn::InstanceNorm);
// Attention: Burn's softmax subtracts the row maximum and the default mask fill (-1e4) fits f16
// (a `min_float` below -65504 is -inf in f16, and a row masked whole is NaN); it makes no tensor
// of its own.
half_layer!(nn::attention::CrossAttention);

/// Attention: Burn's softmax subtracts the row maximum and the default mask fill (-1e4) fits f16
/// (keep `min_float` above -65504). Its dropout and activation have no parameters.
impl Fp16Module for nn::attention::MultiHeadAttention {
    fn wrap_fp16(self, precision: Precision) -> Self {
        cast_params(self, precision)
    }
}

/// Its activation is a skipped field to Burn (no mapper reaches it), so it is cast here: a
/// `PRelu` or `SwiGlu` activation has parameters that meet the half input.
impl Fp16Module for nn::transformer::PositionWiseFeedForward {
    fn wrap_fp16(self, precision: Precision) -> Self {
        let activation = self.activation.clone().wrap_fp16(precision);
        let mut ffn = cast_params(self, precision);
        ffn.activation = activation;
        ffn
    }
}

impl Fp16Module for nn::transformer::TransformerEncoderLayer {
    fn wrap_fp16(mut self, precision: Precision) -> Self {
        self.mha = self.mha.wrap_fp16(precision);
        self.pwff = self.pwff.wrap_fp16(precision);
        self.norm_1 = self.norm_1.wrap_fp16(precision);
        self.norm_2 = self.norm_2.wrap_fp16(precision);
        self
    }
}

impl Fp16Module for nn::transformer::TransformerEncoder {
    fn wrap_fp16(mut self, precision: Precision) -> Self {
        self.layers = self.layers.wrap_fp16(precision);
        self
    }
}

impl Fp16Module for nn::transformer::TransformerDecoderLayer {
    fn wrap_fp16(mut self, precision: Precision) -> Self {
        self.cross_attn = self.cross_attn.wrap_fp16(precision);
        self.self_attn = self.self_attn.wrap_fp16(precision);
        self.pwff = self.pwff.wrap_fp16(precision);
        self.norm_1 = self.norm_1.wrap_fp16(precision);
        self.norm_2 = self.norm_2.wrap_fp16(precision);
        self.norm_3 = self.norm_3.wrap_fp16(precision);
        self
    }
}

impl Fp16Module for nn::transformer::TransformerDecoder {
    fn wrap_fp16(mut self, precision: Precision) -> Self {
        self.layers = self.layers.wrap_fp16(precision);
        self
    }
}

// Not here: Burn's `BatchNorm` (its variance is computed in the input's dtype, which overflows
// f16; its running statistics would meet half batch statistics) and `LocalResponseNorm` (it
// squares its input in f16); the layers that make tensors of their own in the device's default
// dtype (fp32), which then meet half ones: the RNNs (their initial state and output buffer),
// `RotaryEncoding` (its tables), `GaussianNoise` (its noise); `DeformConv2d` (its backend op in
// half is untested here); `CosineSimilarity` and `PairwiseDistance` (their epsilon, 1e-8,
// vanishes in f16). They run as fp32 islands (`Fp32`).

/// The sinusoids are a constant (not a parameter): cast so that `input + sinusoids` meets one
/// dtype.
impl Fp16Module for nn::PositionalEncoding {
    fn wrap_fp16(mut self, precision: Precision) -> Self {
        self.sinusoids = cast_tensor_type(self.sinusoids, DType::F32, precision.dtype());
        self
    }
}

/// Losses that hold class weights: the weights stay fp32, for a loss computed in fp32 (called
/// from a `#[force_fp32]` method, as MMCV's heads do).
impl Fp16Module for nn::loss::CrossEntropyLoss {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

impl Fp16Module for nn::loss::BinaryCrossEntropyLoss {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}
