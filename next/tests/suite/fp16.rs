//! Mixed precision on Burn 0.22 (the runtime `memsave-next`): `#[memsave::model]`'s flag through
//! nesting, `wrap_fp16_model` on Burn's own layers (islands and skipped fields kept fp32),
//! `#[auto_fp16]` and `#[force_fp32]`, and half gradients against fp32 ones, on a conv net and on
//! Burn's transformer.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::activation::ActivationConfig;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::transformer::{
    PositionWiseFeedForward, PositionWiseFeedForwardConfig, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput, TransformerEncoderLayer,
};
use burn::nn::{
    BatchNorm, BatchNormConfig, GroupNorm, GroupNormConfig, LayerNorm, LayerNormConfig, Linear,
    LinearConfig, PReluConfig, PaddingConfig2d, Relu,
};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use memsave_macros::{auto_fp16, force_fp32, model, with_cp};
use memsave_next::checkpoint::set_with_cp;
use memsave_next::fp16::{
    cast_params, wrap_fp16_model, Fp16, Fp16Module, HasFp16Flag, Precision, PrecisionExt,
};

use crate::common;
use common::{assert_same_bits, device, devices, grad_bits, initialized, watchdog};

/// Burn's conv, Burn's `BatchNorm` as an fp32 island (its statistics would overflow f16), ReLU.
#[model]
#[derive(Module, Debug)]
struct ConvBnRelu {
    conv: Conv2d,
    #[fp16(fp32)]
    bn: BatchNorm,
    relu: Relu,
    fp16_enabled: Fp16,
}

impl ConvBnRelu {
    fn new(channels: [usize; 2], device: &Device) -> Self {
        ConvBnRelu {
            conv: Conv2dConfig::new(channels, [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            bn: BatchNormConfig::new(channels[1]).init(device).into(),
            relu: Relu::new(),
            fp16_enabled: Fp16::Off,
        }
    }

    /// `[N, C_in, H, W]` -> `[N, C_out, H, W]`.
    #[auto_fp16]
    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.relu.forward(self.bn.forward(self.conv.forward(x)))
    }
}

/// Burn's `GroupNorm` in half: Burn 0.22 computes its f16 statistics in fp32.
#[model]
#[derive(Module, Debug)]
struct Stage {
    blocks: Vec<ConvBnRelu>,
    norm: GroupNorm,
    fp16_enabled: Fp16,
}

#[model]
#[derive(Module, Debug)]
struct Head {
    linear: Linear,
    fp16_enabled: Fp16,
}

impl Head {
    /// Loss in fp32, whatever precision the features come in.
    #[force_fp32(args = (features))]
    fn loss(&self, features: Tensor<2>, weights: Tensor<2>) -> Tensor<1> {
        (features * weights).sum()
    }
}

/// Three levels: Net -> Stage -> ConvBnRelu, through a `Vec` and an `Option`.
#[model]
#[derive(Module, Debug)]
struct Net {
    stem: ConvBnRelu,
    stage: Stage,
    head: Option<Head>,
    #[fp16(skip)]
    untouched: Linear,
    fp16_enabled: Fp16,
}

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            stem: ConvBnRelu::new([3, 8], device),
            stage: Stage {
                blocks: vec![
                    ConvBnRelu::new([8, 8], device),
                    ConvBnRelu::new([8, 4], device),
                ],
                norm: GroupNormConfig::new(2, 4).init(device),
                fp16_enabled: Fp16::Off,
            },
            head: Some(Head {
                linear: LinearConfig::new(4, 2).init(device),
                fp16_enabled: Fp16::Off,
            }),
            untouched: LinearConfig::new(2, 2).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    /// `[N, 3, H, W]` -> `[N, 4 * H * W]` features.
    #[auto_fp16]
    fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = self.stem.forward(x);
        for block in &self.stage.blocks {
            x = block.forward(x);
        }
        self.stage.norm.forward(x).flatten(1, 3)
    }
}

/// Seeded standard-normal values (splitmix64, Box-Muller).
fn seeded_normal<const D: usize>(shape: [usize; D], seed: u64) -> TensorData {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 + 0.5 / (1u64 << 53) as f64
    };
    let count = shape.iter().product::<usize>();
    let values: Vec<f32> = (0..count)
        .map(|_| {
            let (u, v) = (next(), next());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        })
        .collect();
    TensorData::new(values, shape)
}

fn normal<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<D> {
    Tensor::from_data(seeded_normal(shape, seed), &device())
}

/// Seeded weights: normal with standard deviation `1 / sqrt(fan_in)`, biases zero, and every
/// normalisation layer with gamma 0.2 and beta 1, so that its output sits five standard
/// deviations above ReLU's kink (f16 rounding would otherwise flip activations across it, which
/// measures where the kinks fall, not the casts: 0.21's `tests/suite/wrap_fp16.rs` says how much).
struct SeededInit {
    seed: u64,
    path: Vec<String>,
}

impl ModuleMapper for SeededInit {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.shape().dims::<D>();
        let device = tensor.device();
        self.seed += 1;
        let value: Tensor<D> = match self.path.last().map(String::as_str) {
            Some("gamma") => Tensor::full(dims, 0.2, &device),
            Some("beta") => Tensor::ones(dims, &device),
            Some("bias") => Tensor::zeros(dims, &device),
            _ => {
                let fan_in: usize = dims[1..].iter().product::<usize>().max(1);
                Tensor::<D>::from_data(seeded_normal(dims, self.seed), &device)
                    .div_scalar((fan_in as f32).sqrt())
            }
        };
        Param::from_mapped_value(id, value.require_grad(), mapper)
    }
}

fn seeded<M: Module>(module: M, seed: u64) -> M {
    module.map(&mut SeededInit {
        seed: seed << 8,
        path: Vec::new(),
    })
}

/// `|a - b| / |b|` (Frobenius norms), in fp32.
fn relative_error<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
    let (a, b) = (a.cast(DType::F32), b.cast(DType::F32));
    let num = (a - b.clone()).square().sum().sqrt().into_scalar::<f32>();
    let den = b.square().sum().sqrt().into_scalar::<f32>();
    num / den
}

#[test]
fn flags_are_set_through_three_levels() {
    // Under the watchdog's turn: building the model draws from Flex's one random stream,
    // which the other tests seed.
    watchdog(120, || {
        let model = Net::new(&device());
        assert_eq!(model.fp16_enabled(), Fp16::Off);
        let model = wrap_fp16_model(model, Precision::F16);
        let on = Fp16::On(Precision::F16);
        assert_eq!(model.fp16_enabled, on);
        assert_eq!(model.stem.fp16_enabled, on);
        assert_eq!(model.stage.fp16_enabled, on);
        for block in &model.stage.blocks {
            assert_eq!(block.fp16_enabled, on);
            assert_eq!(block.bn.precision(), Some(Precision::F16));
        }
        assert_eq!(model.head.as_ref().unwrap().fp16_enabled, on);
        // A constant to Burn: kept by `valid()` and `train()`.
        assert_eq!(model.valid().stage.blocks[1].fp16_enabled, on);
        assert_eq!(model.valid().train().fp16_enabled, on);

        let bf16 = wrap_fp16_model(Net::new(&device()), Precision::Bf16);
        assert_eq!(bf16.stage.blocks[1].fp16_enabled, Fp16::On(Precision::Bf16));
    });
}

#[test]
fn weights_are_half_except_islands_and_skipped_fields() {
    // Under the watchdog's turn: building the model draws from Flex's one random stream,
    // which the other tests seed.
    watchdog(120, || {
        let model = Net::new(&device());
        let ids = (model.stem.conv.weight.id, model.stem.bn.inner().gamma.id);
        let model = wrap_fp16_model(model, Precision::F16);
        assert_eq!(model.stem.conv.weight.val().dtype(), DType::F16);
        assert_eq!(model.stage.blocks[1].conv.weight.val().dtype(), DType::F16);
        assert_eq!(
            model.head.as_ref().unwrap().linear.weight.val().dtype(),
            DType::F16
        );
        // Burn 0.22's GroupNorm runs its affine step in the input's dtype: half.
        let norm = &model.stage.norm;
        assert_eq!(norm.gamma.as_ref().unwrap().val().dtype(), DType::F16);
        // The island: weights and running statistics fp32.
        let bn = model.stem.bn.inner();
        assert_eq!(bn.gamma.val().dtype(), DType::F32);
        assert_eq!(bn.running_var.value().dtype(), DType::F32);
        // `#[fp16(skip)]`: as it was.
        assert_eq!(model.untouched.weight.val().dtype(), DType::F32);
        // Still trainable leaves, with their ids.
        assert!(model.stem.conv.weight.val().is_require_grad());
        assert_eq!(
            (model.stem.conv.weight.id, model.stem.bn.inner().gamma.id),
            ids
        );
    });
}

/// The half gradients of a conv-BN-ReLU net (Burn's layers, BatchNorm an island) against the
/// fp32 ones, for 8 seeds of weights, inputs and loss weights.
#[test]
fn half_gradients_match_fp32() {
    watchdog(600, || {
        for (precision, tolerance) in [(Precision::F16, 1e-2), (Precision::Bf16, 6e-2)] {
            let (mut best, mut worst) = (f32::INFINITY, 0.0_f32);
            for seed in 0..8 {
                let fp32 = seeded(Net::new(&device()), seed);
                let half = wrap_fp16_model(fp32.clone(), precision);
                let x = normal([4, 3, 6, 6], seed ^ 0x5EED);
                let weights = normal([4, 4 * 36], seed ^ 0xA11CE);
                let features = half.forward(x.clone());
                assert_eq!(features.dtype(), precision.dtype());
                let loss16 = half.head.as_ref().unwrap().loss(features, weights.clone());
                assert_eq!(
                    loss16.dtype(),
                    DType::F32,
                    "force_fp32 runs the loss in fp32"
                );
                let loss32 = fp32.head.as_ref().unwrap().loss(fp32.forward(x), weights);
                let (g32, g16) = (loss32.backward(), loss16.backward());
                let stem16 = half.stem.conv.weight.grad(&g16).unwrap();
                assert_eq!(stem16.dtype(), precision.dtype());
                let gamma16 = half.stem.bn.inner().gamma.grad(&g16).unwrap();
                assert_eq!(
                    gamma16.dtype(),
                    DType::F32,
                    "the island's gradients are fp32"
                );
                let pairs = [
                    (
                        "stem.conv.weight",
                        fp32.stem.conv.weight.grad(&g32).unwrap(),
                        stem16,
                    ),
                    (
                        "stage.blocks[1].conv.weight",
                        fp32.stage.blocks[1].conv.weight.grad(&g32).unwrap(),
                        half.stage.blocks[1].conv.weight.grad(&g16).unwrap(),
                    ),
                ];
                let gammas = (fp32.stem.bn.inner().gamma.grad(&g32).unwrap(), gamma16);
                let errors = pairs
                    .into_iter()
                    .map(|(name, g32, g16)| (name, relative_error(g16, g32)))
                    .chain([("stem.bn.gamma", relative_error(gammas.1, gammas.0))]);
                for (name, error) in errors {
                    best = best.min(error);
                    worst = worst.max(error);
                    assert!(
                        error < tolerance,
                        "{precision}, seed {seed}, {name}: {error}"
                    );
                    assert!(
                        error > 0.0,
                        "{precision}, seed {seed}, {name}: not half at all"
                    );
                }
            }
            eprintln!(
                "{precision}: relative error of the half gradients {best:.2e} to {worst:.2e}"
            );
        }
    });
}

/// A text model on Burn's own transformer, in half: its LayerNorms (Burn 0.22 computes their f16
/// statistics in fp32), its attention, and a feed-forward whose activation has a parameter.
#[model]
#[derive(Module, Debug)]
struct TextModel {
    embed: Linear,
    encoder: TransformerEncoder,
    ffn: PositionWiseFeedForward,
    norm: LayerNorm,
    fp16_enabled: Fp16,
}

impl TextModel {
    fn new(device: &Device) -> Self {
        TextModel {
            embed: LinearConfig::new(8, 16).init(device),
            encoder: TransformerEncoderConfig::new(16, 32, 2, 2)
                .with_dropout(0.0)
                .init(device),
            ffn: PositionWiseFeedForwardConfig::new(16, 24)
                .with_dropout(0.0)
                .with_activation(ActivationConfig::PRelu(PReluConfig::new().with_alpha(0.1)))
                .init(device),
            norm: LayerNormConfig::new(16).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16(apply_to = (x), out_fp32 = true)]
    fn forward(&self, x: Tensor<3>, mask_pad: Tensor<2, Bool>) -> Tensor<3> {
        let x = self.embed.forward(x);
        let x = self
            .encoder
            .forward(TransformerEncoderInput::new(x).mask_pad(mask_pad));
        self.norm.forward(self.ffn.forward(x))
    }
}

fn text_input() -> (Tensor<3>, Tensor<2, Bool>) {
    let x = normal([2, 5, 8], 7);
    let mask = Tensor::from_data([[false, false, false, true, true], [false; 5]], &device());
    (x, mask)
}

#[test]
fn burn_transformer_in_half_trains_close_to_fp32() {
    watchdog(300, || {
        let fp32 = seeded(TextModel::new(&device()), 3);
        let (x, mask) = text_input();
        // Weighted: the plain sum of a LayerNorm's outputs has no gradient (its outputs sum to
        // beta's sum whatever the input).
        let weights = normal([2, 5, 16], 8);
        let reference = (fp32.forward(x.clone(), mask.clone()) * weights.clone())
            .sum()
            .backward();
        for (precision, tolerance) in [(Precision::F16, 2e-2), (Precision::Bf16, 8e-2)] {
            let half = wrap_fp16_model(fp32.clone(), precision);
            let layer = &half.encoder.layers[1];
            assert_eq!(layer.norm_2.gamma.val().dtype(), precision.dtype());
            assert_eq!(layer.mha.value.weight.val().dtype(), precision.dtype());
            // The feed-forward's activation is a skipped field to Burn: cast all the same.
            let burn::nn::activation::Activation::PRelu(prelu) = &half.ffn.activation else {
                panic!("the activation is a PRelu");
            };
            assert_eq!(prelu.alpha.val().dtype(), precision.dtype());
            let out = half.forward(x.clone(), mask.clone());
            assert_eq!(out.dtype(), DType::F32, "out_fp32");
            let grads = (out * weights.clone()).sum().backward();
            let pairs = [
                (
                    "embed.weight",
                    fp32.embed.weight.grad(&reference).unwrap(),
                    half.embed.weight.grad(&grads).unwrap(),
                ),
                (
                    "encoder.layers[0].pwff.linear_inner.weight",
                    fp32.encoder.layers[0]
                        .pwff
                        .linear_inner
                        .weight
                        .grad(&reference)
                        .unwrap(),
                    half.encoder.layers[0]
                        .pwff
                        .linear_inner
                        .weight
                        .grad(&grads)
                        .unwrap(),
                ),
                (
                    "ffn.linear_outer.weight",
                    fp32.ffn.linear_outer.weight.grad(&reference).unwrap(),
                    half.ffn.linear_outer.weight.grad(&grads).unwrap(),
                ),
            ];
            for (name, g32, g16) in pairs {
                assert_eq!(g16.dtype(), precision.dtype(), "{name}");
                let error = relative_error(g16, g32);
                eprintln!("{precision}, {name}: relative error {error:.2e}");
                assert!(
                    error < tolerance && error > 0.0,
                    "{precision}, {name}: {error}"
                );
            }
        }
    });
}

/// Why Burn 0.22's LayerNorm may run in half, where 0.21's was a compile error: on the input that
/// zeroed 0.21's f16 LayerNorm (`|x - mean|` past 256), 0.22's gives fp32's answer.
#[test]
fn burn_layer_norm_in_f16_survives_large_activations() {
    let _turn = common::one_at_a_time();
    let norm: LayerNorm = LayerNormConfig::new(256).init(&device());
    let values: Vec<f32> = (0..4 * 256)
        .map(|i| (i % 256) as f32 * 3.0 - 384.0)
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(values, [4, 256]), &device());
    let reference = norm.forward(x.clone());
    let half = cast_params(norm, Precision::F16).forward(x.cast(DType::F16));
    assert_eq!(half.dtype(), DType::F16);
    let error = relative_error(half, reference);
    assert!(error < 2e-3, "relative error {error}");
}

/// An island's precision is what `wrap_fp16` told it; a bare layer without an island in an f16
/// model is Burn's `BatchNorm`, which this runtime refuses at compile time (see the module docs).
#[test]
fn fp32_island_runs_in_fp32_and_answers_in_half() {
    let _turn = common::one_at_a_time();
    let island: memsave_next::fp16::Fp32<BatchNorm> =
        BatchNormConfig::new(4).init(&device()).into();
    let island = island.wrap_fp16(Precision::F16);
    let x = normal([2, 4, 3, 3], 11);
    let out = island.forward(x.clone().cast(DType::F16));
    assert_eq!(out.dtype(), DType::F16);
    let reference = island.inner().forward(x.cast(DType::F16).cast(DType::F32));
    let error = relative_error(out, reference);
    assert!(error < 2e-3, "relative error {error}");
}

thread_local! {
    static RUNS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A block of Burn's encoder layer (dropout 0.25), checkpointed by its flag, in a half model.
#[model]
#[derive(Module, Debug)]
struct HalfBlock {
    layer: TransformerEncoderLayer,
    with_cp: bool,
    fp16_enabled: Fp16,
}

impl HalfBlock {
    #[with_cp]
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        RUNS.with(|runs| runs.set(runs.get() + 1));
        self.layer.forward(x, None, None)
    }
}

#[model]
#[derive(Module, Debug)]
struct HalfEncoder {
    embed: Linear,
    #[with_cp]
    blocks: Vec<HalfBlock>,
    fp16_enabled: Fp16,
}

impl HalfEncoder {
    fn new(device: &Device) -> Self {
        let config = TransformerEncoderConfig::new(16, 32, 2, 3).with_dropout(0.25);
        HalfEncoder {
            embed: LinearConfig::new(8, 16).init(device),
            blocks: config
                .init(device)
                .layers
                .into_iter()
                .map(|layer| HalfBlock {
                    layer,
                    with_cp: false,
                    fp16_enabled: Fp16::Off,
                })
                .collect(),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16]
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let mut h = self.embed.forward(x);
        for block in &self.blocks {
            h = block.forward(h);
        }
        h
    }

    /// One step from the stream `seed`: the parameters' gradients, as bits, and how many times
    /// the blocks' forward ran.
    fn step(&self, device: &Device, seed: u64) -> (Vec<Option<Vec<u32>>>, usize) {
        device.seed(seed);
        RUNS.with(|runs| runs.set(0));
        let x = Tensor::<3>::random([2, 6, 8], Distribution::Default, device);
        let out = self.forward(x);
        assert_eq!(out.dtype(), self.fp16_enabled.precision().unwrap().dtype());
        let grads = out.cast(DType::F32).powi_scalar(2).mean().backward();
        (grad_bits(self, &grads), RUNS.with(std::cell::Cell::get))
    }
}

/// Mixed precision and checkpointing together, as a Burn 0.22 user switches them on: the half
/// model with every block checkpointed has the plain half model's gradients, bit for bit, its
/// dropout replayed, under both of Burn's strategies and both half types.
#[test]
fn a_half_model_checkpointed_has_the_plain_half_gradients() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            for precision in [Precision::F16, Precision::Bf16] {
                device.seed(4);
                let model = wrap_fp16_model(initialized(HalfEncoder::new(&device)), precision);
                let (plain, plain_runs) = model.step(&device, 9);
                let model = set_with_cp(model, true);
                let (checkpointed, runs) = model.step(&device, 9);
                let what = format!("{strategy}, {precision}");
                assert_same_bits(&plain, &checkpointed, &what);
                // Each block recomputed once: checkpointed, not run plainly.
                assert_eq!((plain_runs, runs), (3, 6), "{what}");
            }
        }
    });
}

/// What a Burn 0.22 user's own loop does with both strategies on: fp32 masters, the forward on a
/// half copy with every block checkpointed, the loss scaled, AdamW stepped by
/// `MixedPrecision`. Four steps from one seed train the same weights, bit for bit, as the same
/// loop without checkpointing (the blocks' dropout replayed, the stream left as without
/// recomputation), under both of Burn's strategies.
#[test]
fn a_user_loop_with_mixed_precision_and_checkpointing_trains_exactly() {
    use memsave_next::amp::MixedPrecision;
    watchdog(300, || {
        for (strategy, device) in devices() {
            let train = |checkpointed: bool| {
                device.seed(5);
                let mut masters = initialized(HalfEncoder::new(&device));
                masters = set_with_cp(masters, checkpointed);
                let mut optimizer = burn::optim::AdamWConfig::new().init();
                let mut amp = MixedPrecision::for_precision(Precision::F16);
                let mut runs = 0;
                // One seed for the run: each step's input and dropout masks come from where the
                // stream was left by the step before (`MixedPrecision::backward` leaves it as
                // without checkpointing: `memsave_next::checkpoint::backward`).
                device.seed(100);
                for step in 0..4 {
                    RUNS.with(|runs| runs.set(0));
                    let half = amp.half_model(&masters);
                    let x = Tensor::<3>::random([2, 6, 8], Distribution::Default, &device);
                    let loss = half.forward(x).cast(DType::F32).powi_scalar(2).mean();
                    let grads = amp.backward(loss);
                    runs += RUNS.with(std::cell::Cell::get);
                    let (stepped, report) = amp.step(&mut optimizer, 1e-3, masters, &half, grads);
                    masters = stepped;
                    assert!(!report.skipped, "{strategy}: step {step}: {report:?}");
                }
                (common::param_bits(&masters), runs)
            };
            let (plain, plain_runs) = train(false);
            let (checkpointed, runs) = train(true);
            assert_eq!(plain, checkpointed, "{strategy}: the trained weights");
            // Three blocks, four steps: each block recomputed once a step when checkpointed.
            assert_eq!((plain_runs, runs), (12, 24), "{strategy}");
        }
    });
}
