//! fp32 islands (`#[fp16(fp32)]`, `Fp32`) in a half-precision model, on a norm, an attention
//! and an RNN; Burn's norms in a checkpoint-only model.

use crate::common;

use burn::module::Module;
use burn::nn::attention::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig, Lstm, LstmConfig};
use burn::prelude::*;
use burn::tensor::DType;
use common::{max_relative_difference, param_grads, Materialise, AB};
use memsave::auto_fp16;
use memsave::fp16::{cast_params, wrap_fp16_model, Fp16, Fp32, MhaInput, Precision};

/// A sequence encoder whose norm, attention and RNN stay fp32 in a half model.
#[memsave::model]
#[derive(Module, Debug)]
struct Encoder<B: Backend> {
    proj: Linear<B>,
    #[fp16(fp32)]
    norm: LayerNorm<B>,
    #[fp16(fp32)]
    attn: MultiHeadAttention<B>,
    #[fp16(fp32)]
    rnn: Lstm<B>,
    head: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Encoder<B> {
    fn new(device: &B::Device) -> Self {
        Encoder {
            proj: LinearConfig::new(8, 16).init(device),
            norm: LayerNormConfig::new(16).init(device).into(),
            attn: MultiHeadAttentionConfig::new(16, 2)
                .with_dropout(0.0)
                .init(device)
                .into(),
            rnn: LstmConfig::new(16, 12, true).init(device).into(),
            head: LinearConfig::new(12, 4).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16]
    fn forward(&self, x: Tensor<B, 3>, mask: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let x = self.proj.forward(x);
        let x = self.norm.forward(x);
        let x = self
            .attn
            .forward(MhaInput::self_attn(x).mask_pad(mask))
            .context;
        let (x, _) = self.rnn.forward(x, None);
        self.head.forward(x)
    }
}

fn inputs(scale: f32) -> (Tensor<AB, 3>, Tensor<AB, 2, Bool>) {
    let device = Default::default();
    let values: Vec<f32> = (0..2 * 5 * 8)
        .map(|i| ((i * 37 % 23) as f32 / 23.0 - 0.5) * scale)
        .collect();
    let x = Tensor::from_data(TensorData::new(values, [2, 5, 8]), &device);
    let mask = Tensor::from_data([[false, false, false, true, true], [false; 5]], &device);
    (x, mask)
}

#[test]
fn islands_keep_fp32_weights_and_give_half_outputs() {
    let model = wrap_fp16_model(
        Encoder::<AB>::new(&Default::default()).map(&mut Materialise),
        Precision::F16,
    );
    assert_eq!(model.proj.weight.val().dtype(), DType::F16);
    assert_eq!(model.head.weight.val().dtype(), DType::F16);
    assert_eq!(model.norm.inner().gamma.val().dtype(), DType::F32);
    assert_eq!(model.attn.inner().query.weight.val().dtype(), DType::F32);
    assert_eq!(
        model
            .rnn
            .inner()
            .input_gate
            .input_transform
            .weight
            .val()
            .dtype(),
        DType::F32
    );
    assert_eq!(model.norm.precision(), Some(Precision::F16));
    let (x, mask) = inputs(1.0);
    assert_eq!(model.forward(x, mask).dtype(), DType::F16);
}

/// Each precision: the half model's gradients against the fp32 model's, every parameter.
#[test]
fn half_model_with_islands_trains_close_to_fp32() {
    let fp32 = Encoder::<AB>::new(&Default::default()).map(&mut Materialise);
    let (x, mask) = inputs(1.0);
    let reference = {
        let grads = fp32.forward(x.clone(), mask.clone()).sum().backward();
        param_grads(&fp32, &grads)
    };
    for (precision, tolerance) in [(Precision::F16, 2e-2), (Precision::Bf16, 8e-2)] {
        let half = wrap_fp16_model(fp32.clone(), precision);
        let loss = half.forward(x.clone(), mask.clone()).cast(DType::F32).sum();
        let grads = param_grads(&half, &loss.backward());
        assert_eq!(grads.len(), reference.len());
        // Each gradient against its own scale, or the largest one's for a gradient that is zero
        // in exact arithmetic (the attention's key bias): its rounding noise has no scale.
        let largest = reference
            .values()
            .flatten()
            .fold(0.0_f32, |m, v| m.max(v.abs()));
        let mut worst = 0.0_f32;
        for (id, reference) in &reference {
            let scale = reference.iter().fold(0.0_f32, |m, v| m.max(v.abs()));
            let scale = if scale < 1e-3 * largest {
                largest
            } else {
                scale
            };
            let diff = grads[id]
                .iter()
                .zip(reference)
                .fold(0.0_f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff / scale);
        }
        println!("{precision}: worst relative gradient difference {worst:.2e}");
        assert!(worst <= tolerance, "{precision}: {worst} > {tolerance}");
    }
}

/// The failure the island prevents: Burn's LayerNorm cast to f16 gives exact zeros once
/// `|x - mean|` passes ~256 under autodiff; the island gives fp32's answer.
#[test]
fn layer_norm_island_survives_large_activations() {
    let device = Default::default();
    let norm: LayerNorm<AB> = LayerNormConfig::new(256).init(&device);
    let values: Vec<f32> = (0..4 * 256)
        .map(|i| (i % 256) as f32 * 3.0 - 384.0)
        .collect();
    let x = Tensor::<AB, 2>::from_data(TensorData::new(values, [4, 256]), &device);
    let reference = norm.forward(x.clone()).into_data().to_vec::<f32>().unwrap();
    let zeros = |values: &[f32]| values.iter().filter(|v| **v == 0.0).count();
    let half_x = x.cast(DType::F16);

    let island = Fp32::from(norm.clone()).wrap(Precision::F16);
    let out = island.forward(half_x.clone());
    assert_eq!(out.dtype(), DType::F16);
    let out = out.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
    let difference = max_relative_difference(&out, &reference);
    assert!(
        difference < 5e-3,
        "island: relative difference {difference}"
    );
    assert_eq!(zeros(&out), zeros(&reference));

    // What the island replaces, printed for the record (Burn's behaviour, not memsave's).
    let cast = cast_params(norm, Precision::F16);
    let out = cast
        .forward(half_x)
        .cast(DType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    println!(
        "Burn's LayerNorm cast to f16: {} of {} outputs are 0 (fp32: {})",
        zeros(&out),
        out.len(),
        zeros(&reference)
    );
}

/// An island's record is the layer's record: a checkpoint saved without it loads into it.
#[test]
fn an_island_has_its_layers_record() {
    let device = Default::default();
    let linear: Linear<AB> = LinearConfig::new(3, 2).init(&device).map(&mut Materialise);
    let island: Fp32<Linear<AB>> = LinearConfig::new(3, 2).init(&device).into();
    let island = island.load_record(linear.clone().into_record());
    let same = |a: Tensor<AB, 2>, b: Tensor<AB, 2>| {
        a.into_data().to_vec::<f32>().unwrap() == b.into_data().to_vec::<f32>().unwrap()
    };
    assert!(same(island.inner().weight.val(), linear.weight.val()));
    let back: Linear<AB> = LinearConfig::new(3, 2)
        .init(&device)
        .load_record(island.clone().into_record());
    assert!(same(back.weight.val(), linear.weight.val()));
    assert_eq!(island.num_params(), linear.num_params());
}

/// `Fp32::run` for any module: half in, fp32 inside, half out; fp32 in, fp32 out.
#[test]
fn run_casts_around_any_module() {
    let device = Default::default();
    let island = Fp32::from(LinearConfig::new(4, 2).init::<AB>(&device)).wrap(Precision::Bf16);
    let x = Tensor::<AB, 2>::ones([3, 4], &device);
    let seen = std::cell::Cell::new(DType::U8);
    let out = island.run(x.clone().cast(DType::BF16), |linear, x: Tensor<AB, 2>| {
        seen.set(x.dtype());
        linear.forward(x)
    });
    assert_eq!(seen.get(), DType::F32);
    assert_eq!(out.dtype(), DType::BF16);
    assert_eq!(
        island.run(x, |linear, x| linear.forward(x)).dtype(),
        DType::F32
    );
}

trait Wrap: memsave::fp16::Fp16Module {
    fn wrap(self, precision: Precision) -> Self {
        self.wrap_fp16(precision)
    }
}
impl<T: memsave::fp16::Fp16Module> Wrap for T {}
