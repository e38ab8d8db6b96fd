//! Every layer of `burn::nn` in a half-precision model: under `wrap_fp16_model` (half layers)
//! or as an fp32 island (`Fp32`: the normalisations, and the layers that make fp32 tensors of
//! their own), one f16 and one bf16 forward and backward stay within a stated tolerance of
//! fp32: the output, the input's gradient and every parameter's gradient, each as
//! `max |half - fp32| / max |fp32|` of that tensor (a gradient that is zero in exact arithmetic,
//! attention's key bias, whose fp32 values are 5e-7 against 12 elsewhere, is measured against
//! the layer's largest gradient instead: its rounding noise has no scale of its own). The input is representable in bf16, so
//! that both runs see the same input and only the layer's own rounding is measured.
//!
//! Tolerances: f16 1e-2, bf16 5e-2 (bf16 keeps 8 bits of mantissa: one rounding is 4e-3, and a
//! layer rounds its weights, each product and its output). Measured at most 1.9e-3 (f16,
//! Conv2d) and 7.8e-3 (bf16, MultiHeadAttention) over the 61 layers; every layer's figures are
//! printed by `cargo test --test suite burn_layers:: -- --nocapture`. The weights are seeded (see
//! `Reseeded`), so every run measures the same numbers.

use crate::common;

use burn::module::Module;
use burn::nn;
use burn::prelude::*;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorPrimitive};
use common::{max_relative_difference, param_grads, splitmix64, Materialise, AB};
use memsave::checkpoint::{floats, Segment};
use memsave::fp16::{wrap_fp16_model, Fp16Module, Fp32, Precision, PrecisionExt};

const F16_TOLERANCE: f32 = 1e-2;
const BF16_TOLERANCE: f32 = 5e-2;

/// `N(0, scale²)`-like values from a seeded generator (Flex's global stream is left alone).
fn randn<const D: usize>(shape: [usize; D], scale: f32, seed: u64) -> Tensor<AB, D> {
    let mut state = seed;
    let count: usize = shape.iter().product();
    let values: Vec<f32> = (0..count)
        .map(|_| {
            // Sum of 4 uniforms: close enough to a normal for a test input.
            let sum: f32 = (0..4)
                .map(|_| (splitmix64(&mut state) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .sum();
            sum * scale * 1.7
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn flat(tensor: burn::tensor::ops::FloatTensor<AB>) -> Tensor<AB, 1> {
    let tensor = Tensor::<AB, 1>::from_primitive(TensorPrimitive::Float(tensor));
    let count = tensor.shape().num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(
        <AB as FloatTensorOps<AB>>::float_reshape(
            tensor.into_primitive().tensor(),
            Shape::new([count]),
        ),
    ))
}

fn values(tensor: Tensor<AB, 1>) -> Vec<f32> {
    tensor.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

/// One run: the output values, the input's gradient (if it has one), the parameter gradients.
struct Run {
    dtypes: Vec<DType>,
    output: Vec<f32>,
    input_grad: Option<Vec<f32>>,
    params: std::collections::HashMap<burn::module::ParamId, Vec<f32>>,
}

fn run<M: Module<AB>, const D: usize, O: Segment<AB>>(
    layer: &M,
    x: Tensor<AB, D>,
    forward: &dyn Fn(&M, Tensor<AB, D>) -> O,
) -> Run {
    let x = x.require_grad();
    let output = forward(layer, x.clone());
    let outputs: Vec<Tensor<AB, 1>> = floats(&output).into_iter().map(flat).collect();
    let mut loss: Option<Tensor<AB, 1>> = None;
    let mut all = Vec::new();
    let dtypes = outputs.iter().map(Tensor::dtype).collect();
    for (index, y) in outputs.into_iter().enumerate() {
        let count = y.shape().num_elements();
        let weights = randn([count], 1.0, 1000 + index as u64);
        all.extend(values(y.clone()));
        let term = (y.cast(DType::F32) * weights).sum();
        loss = Some(match loss {
            Some(loss) => loss + term,
            None => term,
        });
    }
    let grads = loss.expect("the layer has a float output").backward();
    Run {
        dtypes,
        output: all,
        input_grad: x
            .grad(&grads)
            .map(|grad| grad.cast(DType::F32).into_data().to_vec::<f32>().unwrap()),
        params: param_grads(layer, &grads),
    }
}

fn max_abs(values: &[f32]) -> f32 {
    values.iter().fold(0.0_f32, |m, v| m.max(v.abs()))
}

/// `max |a - b|` over `max(max |b|, floor)`.
fn relative(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0_f32, |m, (x, y)| m.max((x - y).abs()));
    diff / max_abs(b).max(floor).max(f32::MIN_POSITIVE)
}

/// The worst relative difference of a half run from the fp32 one.
fn worst(half: &Run, reference: &Run) -> f32 {
    assert!(
        half.output.iter().all(|v| v.is_finite()),
        "non-finite outputs"
    );
    let mut worst = max_relative_difference(&half.output, &reference.output);
    assert_eq!(
        half.params.len(),
        reference.params.len(),
        "the half run gave gradients to other parameters"
    );
    let mut gradients: Vec<(&Vec<f32>, &Vec<f32>)> = Vec::new();
    if let (Some(half), Some(reference)) = (&half.input_grad, &reference.input_grad) {
        gradients.push((half, reference));
    }
    for (id, reference) in &reference.params {
        let got = half.params.get(id).expect("a parameter lost its gradient");
        gradients.push((got, reference));
    }
    let largest = gradients
        .iter()
        .fold(0.0_f32, |m, (_, reference)| m.max(max_abs(reference)));
    for (got, reference) in gradients {
        assert!(got.iter().all(|v| v.is_finite()), "non-finite gradients");
        worst = worst.max(relative(got, reference, largest));
    }
    worst
}

/// Compares an f16 and a bf16 run of `layer` (wrapped) with its fp32 run, on input `x`.
fn check<M, const D: usize, O>(
    name: &str,
    layer: M,
    x: Tensor<AB, D>,
    forward: impl Fn(&M, Tensor<AB, D>) -> O,
) where
    M: Module<AB> + Fp16Module,
    O: Segment<AB>,
{
    let layer = layer.map(&mut Materialise).map(&mut Reseeded(0));
    // An input that f16 and bf16 both hold exactly.
    let x = Tensor::from_inner(x.inner().cast(DType::BF16).cast(DType::F32));
    let reference = run(&layer, x.clone(), &forward);
    let mut report = Vec::new();
    for (precision, tolerance) in [
        (Precision::F16, F16_TOLERANCE),
        (Precision::Bf16, BF16_TOLERANCE),
    ] {
        let half = wrap_fp16_model(layer.clone(), precision);
        let half_x = Tensor::from_inner(x.clone().inner().cast(precision.dtype()));
        let outcome = run(&half, half_x, &forward);
        assert!(
            outcome
                .dtypes
                .iter()
                .all(|dtype| *dtype == precision.dtype()),
            "{name} in {precision}: outputs in {:?}",
            outcome.dtypes
        );
        let difference = worst(&outcome, &reference);
        report.push(format!("{precision} {difference:.2e}"));
        assert!(
            difference <= tolerance,
            "{name} in {precision}: relative difference {difference} > {tolerance}"
        );
    }
    println!("{name}: {}", report.join(", "));
}

/// Replaces every parameter by seeded values of the same shape and scale (the initialisers
/// draw from Flex's process-wide stream, which tests running in parallel share): every run of
/// a test measures the same layer.
struct Reseeded(u64);

impl burn::module::ModuleMapper<AB> for Reseeded {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<AB, D>>,
    ) -> burn::module::Param<Tensor<AB, D>> {
        self.0 += 1;
        let seed = self.0;
        param.map(|tensor| {
            let dims = tensor.dims();
            let count: usize = dims.iter().product();
            // Biases and scales ~0.5; weights ~1 / sqrt(fan).
            let scale = if D == 1 {
                0.5
            } else {
                1.0 / ((count / dims[0]).max(1) as f32).sqrt()
            };
            let fresh: Tensor<AB, 1> = randn([count], scale, 7000 + seed);
            Tensor::from_inner(fresh.inner().reshape(tensor.shape()))
                .set_require_grad(tensor.is_require_grad())
        })
    }
}

fn device() -> burn::tensor::Device<AB> {
    Default::default()
}

macro_rules! layer_test {
    ($test:ident, $layer:expr, $x:expr, $forward:expr) => {
        #[test]
        fn $test() {
            check(stringify!($test), $layer, $x, $forward);
        }
    };
}

layer_test!(
    linear,
    nn::LinearConfig::new(16, 8).init::<AB>(&device()),
    randn([4, 16], 1.0, 1),
    |m: &nn::Linear<AB>, x| m.forward(x)
);
layer_test!(
    embedding,
    nn::EmbeddingConfig::new(20, 8).init::<AB>(&device()),
    randn([1], 1.0, 2),
    |m: &nn::Embedding<AB>, _x| {
        let tokens = Tensor::<AB, 2, Int>::from_data([[1, 5, 19], [0, 7, 7]], &device());
        m.forward(tokens)
    }
);
layer_test!(
    prelu,
    nn::PReluConfig::new()
        .with_num_parameters(16)
        .init::<AB>(&device()),
    randn([4, 16], 1.0, 3),
    |m: &nn::PRelu<AB>, x| m.forward(x)
);
layer_test!(
    swiglu,
    nn::SwiGluConfig::new(16, 8).init::<AB>(&device()),
    randn([4, 16], 1.0, 4),
    |m: &nn::SwiGlu<AB>, x| m.forward(x)
);
layer_test!(
    activation_wrapper,
    nn::activation::ActivationConfig::PRelu(nn::PReluConfig::new()).init::<AB>(&device()),
    randn([4, 16], 1.0, 5),
    |m: &nn::activation::Activation<AB>, x| m.forward(x)
);
layer_test!(
    conv1d,
    nn::conv::Conv1dConfig::new(3, 4, 3).init::<AB>(&device()),
    randn([2, 3, 10], 1.0, 6),
    |m: &nn::conv::Conv1d<AB>, x| m.forward(x)
);
layer_test!(
    conv2d,
    nn::conv::Conv2dConfig::new([3, 4], [3, 3]).init::<AB>(&device()),
    randn([2, 3, 8, 8], 1.0, 7),
    |m: &nn::conv::Conv2d<AB>, x| m.forward(x)
);
layer_test!(
    conv3d,
    nn::conv::Conv3dConfig::new([2, 3], [3, 3, 3]).init::<AB>(&device()),
    randn([1, 2, 5, 5, 5], 1.0, 8),
    |m: &nn::conv::Conv3d<AB>, x| m.forward(x)
);
layer_test!(
    conv_transpose1d,
    nn::conv::ConvTranspose1dConfig::new([3, 4], 3).init::<AB>(&device()),
    randn([2, 3, 6], 1.0, 9),
    |m: &nn::conv::ConvTranspose1d<AB>, x| m.forward(x)
);
layer_test!(
    conv_transpose2d,
    nn::conv::ConvTranspose2dConfig::new([3, 4], [3, 3]).init::<AB>(&device()),
    randn([2, 3, 5, 5], 1.0, 10),
    |m: &nn::conv::ConvTranspose2d<AB>, x| m.forward(x)
);
layer_test!(
    conv_transpose3d,
    nn::conv::ConvTranspose3dConfig::new([2, 3], [3, 3, 3]).init::<AB>(&device()),
    randn([1, 2, 3, 3, 3], 1.0, 11),
    |m: &nn::conv::ConvTranspose3d<AB>, x| m.forward(x)
);
layer_test!(
    multi_head_attention,
    nn::attention::MultiHeadAttentionConfig::new(16, 2)
        .with_dropout(0.0)
        .init::<AB>(&device()),
    randn([2, 5, 16], 1.0, 20),
    |m: &nn::attention::MultiHeadAttention<AB>, x| {
        let mask = Tensor::<AB, 2, Bool>::from_data(
            [[false, false, false, true, true], [false; 5]],
            &device(),
        );
        let output = m.forward(nn::attention::MhaInput::self_attn(x).mask_pad(mask));
        (output.context, output.weights)
    }
);
layer_test!(
    position_wise_feed_forward,
    nn::transformer::PositionWiseFeedForwardConfig::new(16, 32)
        .with_dropout(0.0)
        .init::<AB>(&device()),
    randn([2, 5, 16], 1.0, 23),
    |m: &nn::transformer::PositionWiseFeedForward<AB>, x| m.forward(x)
);
layer_test!(
    rms_norm,
    nn::RmsNormConfig::new(16).init::<AB>(&device()),
    randn([4, 16], 1.0, 24),
    |m: &nn::RmsNorm<AB>, x| m.forward(x)
);
layer_test!(
    positional_encoding,
    nn::PositionalEncodingConfig::new(16).init::<AB>(&device()),
    randn([2, 5, 16], 1.0, 25),
    |m: &nn::PositionalEncoding<AB>, x| m.forward(x)
);

/// Every parameter-free layer, in turn, on one input.
#[test]
fn parameter_free_layers() {
    let x = || randn([2, 4, 6, 6], 2.0, 30);
    check("relu", nn::Relu::new(), x(), |m, x| m.forward(x));
    check("gelu", nn::Gelu::new(), x(), |m, x| m.forward(x));
    check("sigmoid", nn::Sigmoid::new(), x(), |m, x| m.forward(x));
    check("tanh", nn::Tanh::new(), x(), |m, x| m.forward(x));
    check(
        "leaky_relu",
        nn::LeakyReluConfig::new().init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "hard_sigmoid",
        nn::HardSigmoidConfig::new().init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "hard_swish",
        nn::activation::HardSwish::new(),
        x(),
        |m, x| m.forward(x),
    );
    check("celu", nn::CeluConfig::new().init(), x(), |m, x| {
        m.forward(x)
    });
    check("elu", nn::EluConfig::new().init(), x(), |m, x| m.forward(x));
    check("selu", nn::Selu::new(), x(), |m, x| m.forward(x));
    check("glu", nn::GLU::new(3), x(), |m, x| m.forward(x));
    check("softsign", nn::Softsign::new(), x(), |m, x| m.forward(x));
    check(
        "thresholded_relu",
        nn::ThresholdedReluConfig::new().init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "hard_shrink",
        nn::HardShrinkConfig::new().init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "soft_shrink",
        nn::SoftShrinkConfig::new().init(),
        x(),
        |m, x| m.forward(x),
    );
    check("shrink", nn::ShrinkConfig::new().init(), x(), |m, x| {
        m.forward(x)
    });
    check(
        "unfold4d",
        nn::Unfold4dConfig::new([2, 2]).init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "max_pool2d",
        nn::pool::MaxPool2dConfig::new([2, 2]).init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "avg_pool2d",
        nn::pool::AvgPool2dConfig::new([2, 2]).init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "adaptive_avg_pool2d",
        nn::pool::AdaptiveAvgPool2dConfig::new([3, 3]).init(),
        x(),
        |m, x| m.forward(x),
    );
    check(
        "interpolate2d",
        nn::interpolate::Interpolate2dConfig::new()
            .with_output_size(Some([9, 9]))
            .with_mode(nn::interpolate::InterpolateMode::Linear)
            .init(),
        x(),
        |m, x| m.forward(x),
    );
    let seq = || randn([2, 4, 9], 2.0, 31);
    check(
        "max_pool1d",
        nn::pool::MaxPool1dConfig::new(2).init(),
        seq(),
        |m, x| m.forward(x),
    );
    check(
        "avg_pool1d",
        nn::pool::AvgPool1dConfig::new(2).init(),
        seq(),
        |m, x| m.forward(x),
    );
    check(
        "adaptive_avg_pool1d",
        nn::pool::AdaptiveAvgPool1dConfig::new(3).init(),
        seq(),
        |m, x| m.forward(x),
    );
    check(
        "interpolate1d",
        nn::interpolate::Interpolate1dConfig::new()
            .with_output_size(Some(12))
            .with_mode(nn::interpolate::InterpolateMode::Linear)
            .init(),
        seq(),
        |m, x| m.forward(x),
    );
    // Dropout in training draws a new mask per run: with p = 0 it is the identity.
    check(
        "dropout",
        nn::DropoutConfig::new(0.0).init(),
        x(),
        |m, x| m.forward(x),
    );
}

/// The layers that stay fp32 in a half model, as islands: their input cast to fp32, their
/// output cast back to the input's half type.
mod islands {
    use super::*;

    fn island<M>(layer: M) -> Fp32<M> {
        Fp32::from(layer)
    }

    layer_test!(
        layer_norm,
        island(nn::LayerNormConfig::new(16).init::<AB>(&device())),
        randn([4, 3, 16], 1.0, 40),
        |m: &Fp32<nn::LayerNorm<AB>>, x| m.forward(x)
    );
    layer_test!(
        batch_norm,
        island(nn::BatchNormConfig::new(4).init::<AB>(&device())),
        randn([2, 4, 5, 5], 1.0, 41),
        |m: &Fp32<nn::BatchNorm<AB>>, x| m.forward(x)
    );
    layer_test!(
        group_norm,
        island(nn::GroupNormConfig::new(2, 4).init::<AB>(&device())),
        randn([2, 4, 5, 5], 1.0, 42),
        |m: &Fp32<nn::GroupNorm<AB>>, x| m.forward(x)
    );
    layer_test!(
        instance_norm,
        island(nn::InstanceNormConfig::new(4).init::<AB>(&device())),
        randn([2, 4, 5, 5], 1.0, 43),
        |m: &Fp32<nn::InstanceNorm<AB>>, x| m.forward(x)
    );
    layer_test!(
        local_response_norm,
        island(nn::LocalResponseNormConfig::new(3).init()),
        randn([2, 4, 5, 5], 1.0, 44),
        |m: &Fp32<nn::LocalResponseNorm>, x| m.forward(x)
    );
    layer_test!(
        normalization,
        island(
            nn::norm::NormalizationConfig::Layer(nn::LayerNormConfig::new(16))
                .init::<AB>(&device())
        ),
        randn([4, 16], 1.0, 45),
        |m: &Fp32<nn::norm::Normalization<AB>>, x| m.forward(x)
    );
    layer_test!(
        softplus,
        island(nn::SoftplusConfig::new().init()),
        randn([4, 16], 4.0, 46),
        |m: &Fp32<nn::Softplus>, x| m.forward(x)
    );
    layer_test!(
        gaussian_noise,
        island(nn::GaussianNoiseConfig::new(0.0).init()),
        randn([4, 16], 1.0, 47),
        |m: &Fp32<nn::GaussianNoise>, x| m.forward(x)
    );
    layer_test!(
        transformer_encoder,
        island(
            nn::transformer::TransformerEncoderConfig::new(16, 32, 2, 2)
                .with_dropout(0.0)
                .with_norm_first(true)
                .init::<AB>(&device())
        ),
        randn([2, 5, 16], 1.0, 48),
        |m: &Fp32<nn::transformer::TransformerEncoder<AB>>, x| {
            let mask = Tensor::<AB, 2, Bool>::from_data(
                [[false, false, false, true, true], [false; 5]],
                &device(),
            );
            m.forward(memsave::fp16::TransformerEncoderInput::new(x).mask_pad(mask))
        }
    );
    layer_test!(
        transformer_decoder,
        island(
            nn::transformer::TransformerDecoderConfig::new(16, 32, 2, 1)
                .with_dropout(0.0)
                .init::<AB>(&device())
        ),
        randn([2, 4, 16], 1.0, 49),
        |m: &Fp32<nn::transformer::TransformerDecoder<AB>>, x| {
            let memory = randn([2, 6, 16], 1.0, 50);
            m.forward(memsave::fp16::TransformerDecoderInput::new(x, memory))
        }
    );
    layer_test!(
        multi_head_attention,
        island(
            nn::attention::MultiHeadAttentionConfig::new(16, 2)
                .with_dropout(0.0)
                .init::<AB>(&device())
        ),
        randn([2, 5, 16], 1.0, 51),
        |m: &Fp32<nn::attention::MultiHeadAttention<AB>>, x| {
            let mask = Tensor::<AB, 2, Bool>::from_data(
                [[false, false, false, true, true], [false; 5]],
                &device(),
            );
            let output = m.forward(memsave::fp16::MhaInput::self_attn(x).mask_pad(mask));
            (output.context, output.weights)
        }
    );

    layer_test!(
        deform_conv2d,
        island(nn::conv::DeformConv2dConfig::new([2, 4], [3, 3]).init::<AB>(&device())),
        randn([1, 2, 6, 6], 1.0, 12),
        |m: &Fp32<nn::conv::DeformConv2d<AB>>, x| {
            let offset = randn([1, 18, 4, 4], 0.5, 13);
            m.forward(x, offset, None)
        }
    );

    layer_test!(
        rnn,
        island(nn::RnnConfig::new(8, 6, true).init::<AB>(&device())),
        randn([2, 5, 8], 1.0, 14),
        |m: &Fp32<nn::Rnn<AB>>, x| {
            let (out, state) = m.forward(x, None);
            (out, state.hidden)
        }
    );

    layer_test!(
        bi_rnn,
        island(nn::BiRnnConfig::new(8, 6, true).init::<AB>(&device())),
        randn([2, 5, 8], 1.0, 15),
        |m: &Fp32<nn::BiRnn<AB>>, x| {
            let (out, state) = m.forward(x, None);
            (out, state.hidden)
        }
    );

    layer_test!(
        gru,
        island(nn::GruConfig::new(8, 6, true).init::<AB>(&device())),
        randn([2, 5, 8], 1.0, 16),
        |m: &Fp32<nn::Gru<AB>>, x| m.forward(x, None)
    );

    layer_test!(
        bi_gru,
        island(nn::BiGruConfig::new(8, 6, true).init::<AB>(&device())),
        randn([2, 5, 8], 1.0, 17),
        |m: &Fp32<nn::BiGru<AB>>, x| m.forward(x, None)
    );

    layer_test!(
        lstm,
        island(nn::LstmConfig::new(8, 6, true).init::<AB>(&device())),
        randn([2, 5, 8], 1.0, 18),
        |m: &Fp32<nn::Lstm<AB>>, x| {
            let (out, state) = m.forward(x, None);
            (out, state.cell, state.hidden)
        }
    );

    layer_test!(
        bi_lstm,
        island(nn::BiLstmConfig::new(8, 6, true).init::<AB>(&device())),
        randn([2, 5, 8], 1.0, 19),
        |m: &Fp32<nn::BiLstm<AB>>, x| {
            let (out, state) = m.forward(x, None);
            (out, state.cell, state.hidden)
        }
    );

    layer_test!(
        cross_attention,
        island(
            nn::attention::CrossAttentionConfig::new(16, 12, 2, 2, 8)
                .with_dropout(0.0)
                .init::<AB>(&device())
        ),
        randn([2, 5, 16], 1.0, 21),
        |m: &Fp32<nn::attention::CrossAttention<AB>>, x| {
            let context = randn([2, 3, 12], 1.0, 22);
            m.forward(x, context, None)
        }
    );

    layer_test!(
        rotary_encoding,
        island(nn::RotaryEncodingConfig::new(8, 16).init::<AB>(&device())),
        randn([2, 5, 16], 1.0, 26),
        |m: &Fp32<nn::RotaryEncoding<AB>>, x| m.forward(x)
    );
}
