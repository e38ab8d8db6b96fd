//! Every layer of burn-nn 0.22.1 that `wrap_fp16` casts to half runs a forward and a backward in
//! f16 on Flex (which panics where two dtypes meet in one op): a half output, and a finite half
//! gradient for every parameter. What the layer table in `memsave_next::fp16` promises.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::activation::ActivationConfig;
use burn::nn::attention::{CrossAttentionConfig, MhaInput, MultiHeadAttentionConfig};
use burn::nn::conv::{
    Conv1dConfig, Conv2dConfig, Conv3dConfig, ConvTranspose1dConfig, ConvTranspose2dConfig,
    ConvTranspose3dConfig,
};
use burn::nn::transformer::{
    PositionWiseFeedForwardConfig, TransformerDecoderConfig, TransformerDecoderInput,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    EmbeddingConfig, GroupNormConfig, InstanceNormConfig, LayerNormConfig, LinearConfig,
    PReluConfig, PositionalEncodingConfig, RmsNormConfig, SwiGluConfig,
};
use burn::prelude::*;
use burn::tensor::{DType, Distribution, Gradients};
use memsave_next::fp16::{Fp16Module, Precision};

use crate::common;
use common::{device, watchdog};

/// Every float parameter's gradient: present, f16, finite.
struct HalfGrads<'a> {
    grads: &'a Gradients,
    checked: usize,
    layer: &'static str,
}

impl ModuleVisitor for HalfGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        assert_eq!(value.dtype(), DType::F16, "{}: a parameter", self.layer);
        let grad = value
            .grad(self.grads)
            .unwrap_or_else(|| panic!("{}: a parameter without gradient", self.layer));
        assert_eq!(grad.dtype(), DType::F16, "{}: a gradient", self.layer);
        let values = grad.into_data().convert::<f32>();
        let values = values.as_slice::<f32>().unwrap();
        assert!(
            values.iter().all(|v| v.is_finite()),
            "{}: not finite",
            self.layer
        );
        self.checked += 1;
    }
}

/// `layer` wrapped in f16, run by `forward` on a half input: its output half, its gradients half
/// and finite. Returns how many parameters were checked.
fn in_half<M: Module + Fp16Module, const D: usize>(
    layer: &'static str,
    module: M,
    forward: impl Fn(&M) -> Tensor<D>,
) -> usize {
    let module = module.wrap_fp16(Precision::F16);
    let out = forward(&module);
    assert_eq!(out.dtype(), DType::F16, "{layer}: the output");
    if module.num_params() == 0 {
        return 0;
    }
    let grads = out.cast(DType::F32).powi_scalar(2).mean().backward();
    let mut visitor = HalfGrads {
        grads: &grads,
        checked: 0,
        layer,
    };
    module.visit(&mut visitor);
    visitor.checked
}

fn half<const D: usize>(shape: [usize; D]) -> Tensor<D> {
    Tensor::<D>::random(shape, Distribution::Normal(0.0, 1.0), &device()).cast(DType::F16)
}

#[test]
fn every_half_layer_of_burn_runs_forward_and_backward_in_f16() {
    watchdog(300, || {
        let d = &device();
        device().seed(7);
        let mut checked = 0;
        checked += in_half("Linear", LinearConfig::new(4, 6).init(d), |m| {
            m.forward(half([2, 4]))
        });
        checked += in_half("Embedding", EmbeddingConfig::new(10, 6).init(d), |m| {
            m.forward(Tensor::<2, Int>::from_data([[1, 2, 3], [4, 5, 9]], d))
        });
        checked += in_half(
            "PRelu",
            PReluConfig::new().with_num_parameters(4).init(d),
            |m| m.forward(half([2, 4])),
        );
        checked += in_half("SwiGlu", SwiGluConfig::new(4, 6).init(d), |m| {
            m.forward(half([2, 4]))
        });
        let activation = ActivationConfig::PRelu(PReluConfig::new());
        checked += in_half("Activation::PRelu", activation.init(d), |m| {
            m.forward(half([2, 4]))
        });
        checked += in_half("Conv1d", Conv1dConfig::new(2, 3, 3).init(d), |m| {
            m.forward(half([1, 2, 8]))
        });
        checked += in_half("Conv2d", Conv2dConfig::new([2, 3], [3, 3]).init(d), |m| {
            m.forward(half([1, 2, 5, 5]))
        });
        checked += in_half(
            "Conv3d",
            Conv3dConfig::new([2, 3], [2, 2, 2]).init(d),
            |m| m.forward(half([1, 2, 4, 4, 4])),
        );
        checked += in_half(
            "ConvTranspose1d",
            ConvTranspose1dConfig::new([2, 3], 3).init(d),
            |m| m.forward(half([1, 2, 6])),
        );
        let config = ConvTranspose2dConfig::new([2, 3], [3, 3]);
        checked += in_half("ConvTranspose2d", config.init(d), |m| {
            m.forward(half([1, 2, 4, 4]))
        });
        let config = ConvTranspose3dConfig::new([2, 3], [2, 2, 2]);
        checked += in_half("ConvTranspose3d", config.init(d), |m| {
            m.forward(half([1, 2, 3, 3, 3]))
        });
        checked += in_half("RmsNorm", RmsNormConfig::new(4).init(d), |m| {
            m.forward(half([2, 4]))
        });
        checked += in_half("LayerNorm", LayerNormConfig::new(4).init(d), |m| {
            m.forward(half([2, 4]))
        });
        checked += in_half("GroupNorm", GroupNormConfig::new(2, 4).init(d), |m| {
            m.forward(half([2, 4, 3]))
        });
        checked += in_half(
            "InstanceNorm",
            InstanceNormConfig::new(4).with_affine(true).init(d),
            |m| m.forward(half([2, 4, 3])),
        );
        let config = MultiHeadAttentionConfig::new(8, 2).with_dropout(0.1);
        checked += in_half("MultiHeadAttention", config.init(d), |m| {
            m.forward(MhaInput::self_attn(half([2, 3, 8]))).context
        });
        let config = CrossAttentionConfig::new(8, 6, 2, 1, 4).with_dropout(0.1);
        checked += in_half("CrossAttention", config.init(d), |m| {
            m.forward(half([2, 3, 8]), half([2, 5, 6]), None)
        });
        let config = PositionWiseFeedForwardConfig::new(8, 12)
            .with_activation(ActivationConfig::PRelu(PReluConfig::new()));
        checked += in_half("PositionWiseFeedForward", config.init(d), |m| {
            m.forward(half([2, 3, 8]))
        });
        let config = TransformerEncoderConfig::new(8, 12, 2, 2);
        checked += in_half("TransformerEncoder", config.init(d), |m| {
            m.forward(TransformerEncoderInput::new(half([2, 3, 8])))
        });
        let config = TransformerDecoderConfig::new(8, 12, 2, 2);
        checked += in_half("TransformerDecoder", config.init(d), |m| {
            m.forward(TransformerDecoderInput::new(
                half([2, 3, 8]),
                half([2, 5, 8]),
            ))
        });
        // No parameter: its table is cast with the layer.
        checked += in_half(
            "PositionalEncoding",
            PositionalEncodingConfig::new(8).init(d),
            |m| m.forward(half([2, 3, 8])),
        );
        // A parameter of each layer at least (the encoder's and decoder's two layers each).
        assert!(checked > 80, "{checked} parameters checked");
    });
}
