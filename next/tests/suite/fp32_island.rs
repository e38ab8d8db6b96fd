//! fp32 islands on Burn 0.22 (`#[fp16(fp32)]`, `Fp32`) in a half-precision model: Burn's
//! attention (through memsave's `MhaInput`), an LSTM (whose zero state is fp32) and a
//! BatchNorm stay fp32 while the rest runs in half; an island's record is its layer's.

use burn::module::Module;
use burn::nn::attention::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Lstm, LstmConfig};
use burn::prelude::*;
use burn::tensor::DType;
use memsave_macros::{auto_fp16, model};
use memsave_next::fp16::{wrap_fp16_model, Fp16, Fp16Module, Fp32, MhaInput, Precision};

use crate::common;
use common::{device, grad_bits, initialized, watchdog};

/// A sequence encoder whose attention, RNN and BatchNorm stay fp32 in a half model.
#[model]
#[derive(Module, Debug)]
struct Encoder {
    proj: Linear,
    #[fp16(fp32)]
    attn: MultiHeadAttention,
    #[fp16(fp32)]
    rnn: Lstm,
    #[fp16(fp32)]
    norm: BatchNorm,
    head: Linear,
    fp16_enabled: Fp16,
}

impl Encoder {
    fn new(device: &Device) -> Self {
        Encoder {
            proj: LinearConfig::new(8, 16).init(device),
            attn: MultiHeadAttentionConfig::new(16, 2)
                .with_dropout(0.0)
                .init(device)
                .into(),
            rnn: LstmConfig::new(16, 12, true).init(device).into(),
            norm: BatchNormConfig::new(5).init(device).into(),
            head: LinearConfig::new(12, 4).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16]
    fn forward(&self, x: Tensor<3>, mask: Tensor<2, Bool>) -> Tensor<3> {
        let x = self.proj.forward(x);
        let x = self
            .attn
            .forward(MhaInput::self_attn(x).mask_pad(mask))
            .context;
        let (x, _) = self.rnn.forward(x, None);
        // BatchNorm over the sequence positions as channels: `[batch, 5, 12]`.
        self.head.forward(self.norm.forward(x))
    }
}

fn inputs(scale: f32) -> (Tensor<3>, Tensor<2, Bool>) {
    let values: Vec<f32> = (0..2 * 5 * 8)
        .map(|i| ((i * 37 % 23) as f32 / 23.0 - 0.5) * scale)
        .collect();
    let x = Tensor::from_data(TensorData::new(values, [2, 5, 8]), &device());
    let mask = Tensor::from_data([[false, false, false, true, true], [false; 5]], &device());
    (x, mask)
}

#[test]
fn islands_keep_fp32_weights_and_give_half_outputs() {
    watchdog(120, || {
        let model = wrap_fp16_model(initialized(Encoder::new(&device())), Precision::F16);
        assert_eq!(model.proj.weight.val().dtype(), DType::F16);
        assert_eq!(model.head.weight.val().dtype(), DType::F16);
        assert_eq!(model.attn.inner().query.weight.val().dtype(), DType::F32);
        let gate = &model.rnn.inner().input_gate.input_transform;
        assert_eq!(gate.weight.val().dtype(), DType::F32);
        assert_eq!(model.norm.inner().running_mean.value().dtype(), DType::F32);
        assert_eq!(model.norm.precision(), Some(Precision::F16));
        let (x, mask) = inputs(1.0);
        assert_eq!(model.forward(x, mask).dtype(), DType::F16);
    });
}

/// Each precision: the half model's gradients against the fp32 model's, every parameter.
#[test]
fn half_model_with_islands_trains_close_to_fp32() {
    watchdog(300, || {
        let fp32 = initialized(Encoder::new(&device()));
        let (x, mask) = inputs(1.0);
        let weights = Tensor::<3>::from_data(
            TensorData::new(
                (0..2 * 5 * 4)
                    .map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0)
                    .collect(),
                [2, 5, 4],
            ),
            &device(),
        );
        let loss = |model: &Encoder| {
            (model.forward(x.clone(), mask.clone()).cast(DType::F32) * weights.clone()).sum()
        };
        let reference = grad_bits(&fp32, &loss(&fp32).backward());
        let values = |bits: &Vec<u32>| bits.iter().map(|b| f32::from_bits(*b)).collect::<Vec<_>>();
        for (precision, tolerance) in [(Precision::F16, 2e-2), (Precision::Bf16, 8e-2)] {
            let half = wrap_fp16_model(fp32.clone(), precision);
            let grads = grad_bits(&half, &loss(&half).backward());
            assert_eq!(grads.len(), reference.len());
            // Each gradient against its own scale, or the largest one's for a gradient that is
            // zero in exact arithmetic (the attention's key bias): its rounding noise has no scale.
            let largest = reference
                .iter()
                .flatten()
                .flat_map(values)
                .fold(0.0_f32, |m, v| m.max(v.abs()));
            let mut worst = 0.0_f32;
            for (index, (expected, actual)) in reference.iter().zip(&grads).enumerate() {
                let (Some(expected), Some(actual)) = (expected, actual) else {
                    assert_eq!(expected.is_some(), actual.is_some(), "parameter {index}");
                    continue;
                };
                let (expected, actual) = (values(expected), values(actual));
                let scale = expected.iter().fold(0.0_f32, |m, v| m.max(v.abs()));
                let scale = if scale < 1e-3 * largest {
                    largest
                } else {
                    scale
                };
                let diff = actual
                    .iter()
                    .zip(&expected)
                    .fold(0.0_f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(diff / scale);
            }
            eprintln!("{precision}: worst relative gradient difference {worst:.2e}");
            assert!(worst <= tolerance && worst > 0.0, "{precision}: {worst}");
        }
    });
}

/// An island's record is the layer's record: a file saved without it loads into it, and back.
#[test]
fn an_island_has_its_layers_record() {
    // Under the watchdog's turn: building the model draws from Flex's one random stream,
    // which the other tests seed.
    watchdog(120, || {
        let linear: Linear = initialized(LinearConfig::new(3, 2).init(&device()));
        let island: Fp32<Linear> = LinearConfig::new(3, 2).init(&device()).into();
        let island = island.load_record(linear.clone().into_record());
        let same = |a: Tensor<2>, b: Tensor<2>| common::bits(a) == common::bits(b);
        assert!(same(island.inner().weight.val(), linear.weight.val()));
        let back: Linear = LinearConfig::new(3, 2)
            .init(&device())
            .load_record(island.clone().into_record());
        assert!(same(back.weight.val(), linear.weight.val()));
        assert_eq!(island.num_params(), linear.num_params());
    });
}

/// `Fp32::run` for any module: half in, fp32 inside, half out; fp32 in, fp32 out.
#[test]
fn run_casts_around_any_module() {
    // Under the watchdog's turn: building the model draws from Flex's one random stream,
    // which the other tests seed.
    watchdog(120, || {
        let island = Fp32::from(LinearConfig::new(4, 2).init(&device())).wrap_fp16(Precision::Bf16);
        let x = Tensor::<2>::ones([3, 4], &device());
        let seen = std::cell::Cell::new(DType::U8);
        let out = island.run(
            x.clone().cast(DType::BF16),
            |linear: &Linear, x: Tensor<2>| {
                seen.set(x.dtype());
                linear.forward(x)
            },
        );
        assert_eq!(seen.get(), DType::F32);
        assert_eq!(out.dtype(), DType::BF16);
        assert_eq!(
            island.run(x, |linear, x| linear.forward(x)).dtype(),
            DType::F32
        );
    });
}
