//! `wrap_fp16_model`: flags through nesting, normalisation layers kept fp32, and AMP gradients
//! against fp32 gradients.

use crate::common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use memsave::fp16::{wrap_fp16_model, Fp16, HasFp16Flag, Precision};
use memsave::nn::{BatchNorm, BatchNormConfig, GroupNorm, GroupNormConfig};
use memsave::{auto_fp16, force_fp32};

type AB = Autodiff<Flex>;

#[memsave::model]
#[derive(Module, Debug)]
struct ConvBnRelu<B: Backend> {
    conv: Conv2d<B>,
    bn: BatchNorm<B>,
    relu: Relu,
    fp16_enabled: Fp16,
}

impl<B: Backend> ConvBnRelu<B> {
    fn new(channels: [usize; 2], device: &B::Device) -> Self {
        ConvBnRelu {
            conv: Conv2dConfig::new(channels, [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            bn: BatchNormConfig::new(channels[1]).init(device),
            relu: Relu::new(),
            fp16_enabled: Fp16::Off,
        }
    }

    /// `[N, C_in, H, W]` -> `[N, C_out, H, W]`.
    #[auto_fp16]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.relu.forward(self.bn.forward(self.conv.forward(x)))
    }
}

#[memsave::model]
#[derive(Module, Debug)]
struct Stage<B: Backend> {
    blocks: Vec<ConvBnRelu<B>>,
    norm: GroupNorm<B>,
    fp16_enabled: Fp16,
}

#[memsave::model]
#[derive(Module, Debug)]
struct Head<B: Backend> {
    linear: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Head<B> {
    /// Loss in fp32, whatever precision the features come in.
    #[force_fp32(args = (features))]
    fn loss(&self, features: Tensor<B, 2>, weights: Tensor<B, 2>) -> Tensor<B, 1> {
        (features * weights).sum()
    }
}

/// Three levels: Net -> Stage -> ConvBnRelu, through a `Vec` and an `Option`.
#[memsave::model]
#[derive(Module, Debug)]
struct Net<B: Backend> {
    stem: ConvBnRelu<B>,
    stage: Stage<B>,
    head: Option<Head<B>>,
    #[fp16(skip)]
    untouched: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Net<B> {
    fn new(device: &B::Device) -> Self {
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
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let mut x = self.stem.forward(x);
        for block in &self.stage.blocks {
            x = block.forward(x);
        }
        self.stage.norm.forward(x).flatten(1, 3)
    }
}

/// Forces every lazy parameter to initialise, so that clones share their values.
struct Materialise;
impl<B: Backend> ModuleMapper<B> for Materialise {}

fn net() -> Net<AB> {
    Net::new(&Default::default()).map(&mut Materialise)
}

#[test]
fn flags_are_set_through_three_levels() {
    let model = net();
    assert_eq!(model.fp16_enabled(), Fp16::Off);
    let model = wrap_fp16_model(model, Precision::F16);
    let on = Fp16::On(Precision::F16);
    assert_eq!(model.fp16_enabled, on);
    assert_eq!(model.stem.fp16_enabled, on);
    assert_eq!(model.stem.bn.fp16_enabled, on);
    assert_eq!(model.stage.fp16_enabled, on);
    assert_eq!(model.stage.norm.fp16_enabled, on);
    for block in &model.stage.blocks {
        assert_eq!(block.fp16_enabled, on);
        assert_eq!(block.bn.fp16_enabled, on);
    }
    assert_eq!(model.head.as_ref().unwrap().fp16_enabled, on);

    let bf16 = wrap_fp16_model(net(), Precision::Bf16);
    assert_eq!(bf16.stage.blocks[1].fp16_enabled, Fp16::On(Precision::Bf16));
}

#[test]
fn weights_are_half_except_normalisation_and_skipped_fields() {
    let model = wrap_fp16_model(net(), Precision::F16);
    assert_eq!(model.stem.conv.weight.val().dtype(), DType::F16);
    assert_eq!(model.stage.blocks[1].conv.weight.val().dtype(), DType::F16);
    let head = model.head.as_ref().unwrap();
    assert_eq!(head.linear.weight.val().dtype(), DType::F16);
    // Normalisation stays fp32: weights and running statistics.
    assert_eq!(model.stem.bn.gamma.val().dtype(), DType::F32);
    assert_eq!(model.stem.bn.running_var.value().dtype(), DType::F32);
    assert_eq!(model.stage.norm.gamma.val().dtype(), DType::F32);
    // `#[fp16(skip)]`: as it was.
    assert_eq!(model.untouched.weight.val().dtype(), DType::F32);
    // Still trainable leaves with their ids.
    assert!(model.stem.conv.weight.val().is_require_grad());
}

#[test]
fn parameter_ids_are_kept() {
    let model = net();
    let before = model.stem.conv.weight.id;
    let model = wrap_fp16_model(model, Precision::F16);
    assert_eq!(model.stem.conv.weight.id, before);
}

#[test]
fn normalisation_outputs_are_half_and_computed_in_fp32() {
    let device = Default::default();
    let bn: BatchNorm<AB> = BatchNormConfig::new(4).init(&device);
    let gn: GroupNorm<AB> = GroupNormConfig::new(2, 4).init(&device);
    let (bn, gn) = (bn.wrap_fp16(Precision::F16), gn.wrap_fp16(Precision::F16));
    let x = Tensor::<AB, 4>::random([2, 4, 3, 3], Distribution::Normal(0.0, 1.0), &device);
    let half = x.clone().cast(DType::F16);
    let bn_out = bn.forward(half.clone());
    let gn_out = gn.forward(half.clone());
    assert_eq!(bn_out.dtype(), DType::F16);
    assert_eq!(gn_out.dtype(), DType::F16);
    // The same layers unwrapped, in fp32 on the half-rounded input: equal up to the output's
    // rounding to half.
    let bn32: BatchNorm<AB> = BatchNormConfig::new(4).init(&device);
    let expected = bn32.forward(half.cast(DType::F32));
    let diff = (bn_out.cast(DType::F32) - expected)
        .abs()
        .max()
        .into_scalar();
    assert!(diff < 4e-3, "BatchNorm in fp32 vs wrapped: max diff {diff}");
}

use memsave::fp16::Fp16Module;

/// `|a - b| / |b|` over all elements (Frobenius norms).
fn relative_error<const D: usize>(a: Tensor<Flex, D>, b: Tensor<Flex, D>) -> f32 {
    let a = a.cast(DType::F32);
    let b = b.cast(DType::F32);
    let num = (a - b.clone()).square().sum().sqrt().into_scalar();
    let den = b.square().sum().sqrt().into_scalar();
    num / den
}

/// Seeded standard-normal values (splitmix64, Box-Muller).
fn seeded_normal<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<AB, D> {
    let mut state = seed;
    let mut uniform =
        move || ((common::splitmix64(&mut state) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let count = shape.iter().product::<usize>();
    let values: Vec<f32> = (0..count)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// Seeded weights, deterministic under parallel tests: conv and linear weights normal with
/// standard deviation `1 / sqrt(fan_in)`, biases zero, and every normalisation layer with gamma
/// 0.2 and beta 1, so that its output sits five standard deviations above ReLU's kink
/// (see `amp_gradients_match_fp32_within_1e_2`).
struct SeededInit {
    seed: u64,
    path: Vec<String>,
}

impl<B: Backend> ModuleMapper<B> for SeededInit {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<B, D>>,
    ) -> burn::module::Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.shape().dims::<D>();
        let device = tensor.device();
        self.seed += 1;
        let value: Tensor<B, D> = match self.path.last().map(String::as_str) {
            Some("gamma") => Tensor::full(dims, 0.2, &device),
            Some("beta") => Tensor::ones(dims, &device),
            Some("bias") => Tensor::zeros(dims, &device),
            _ => {
                let fan_in: usize = dims[1..].iter().product();
                let noise = seeded_normal(dims, self.seed).inner().into_data();
                Tensor::<B, D>::from_data(noise, &device).div_scalar((fan_in as f32).sqrt())
            }
        };
        burn::module::Param::from_mapped_value(id, value.require_grad(), mapper)
    }
}

/// Relative errors of three f16 gradients against the fp32 ones, for seeded weights, inputs
/// and loss weights.
fn amp_errors(seed: u64) -> Vec<(&'static str, f32)> {
    let model = Net::<AB>::new(&Default::default()).map(&mut SeededInit {
        seed: seed << 8,
        path: Vec::new(),
    });
    let fp32 = model.clone();
    let fp16 = wrap_fp16_model(model, Precision::F16);

    let x = seeded_normal([4, 3, 6, 6], seed ^ 0x5EED);
    let weights = seeded_normal([4, 4 * 36], seed ^ 0xA11CE);
    let loss32 = fp32
        .head
        .as_ref()
        .unwrap()
        .loss(fp32.forward(x.clone()), weights.clone());
    let loss16 = fp16
        .head
        .as_ref()
        .unwrap()
        .loss(fp16.forward(x.clone()), weights.clone());
    assert_eq!(fp16.forward(x.clone()).dtype(), DType::F16);
    assert_eq!(
        loss16.dtype(),
        DType::F32,
        "force_fp32 runs the loss in fp32"
    );
    let g32 = loss32.backward();
    let g16 = loss16.backward();

    let pairs = [
        (
            "stem.conv.weight",
            fp32.stem.conv.weight.grad(&g32),
            fp16.stem.conv.weight.grad(&g16),
        ),
        (
            "stage.blocks[1].conv.weight",
            fp32.stage.blocks[1].conv.weight.grad(&g32),
            fp16.stage.blocks[1].conv.weight.grad(&g16),
        ),
        (
            "stem.bn.gamma",
            fp32.stem
                .bn
                .gamma
                .grad(&g32)
                .map(|g| g.reshape([1, 8, 1, 1])),
            fp16.stem
                .bn
                .gamma
                .grad(&g16)
                .map(|g| g.reshape([1, 8, 1, 1])),
        ),
    ];
    assert_eq!(
        fp16.stem.conv.weight.grad(&g16).unwrap().dtype(),
        DType::F16
    );
    assert_eq!(fp16.stem.bn.gamma.grad(&g16).unwrap().dtype(), DType::F32);
    pairs
        .into_iter()
        .map(|(name, g32, g16)| (name, relative_error(g16.expect(name), g32.expect(name))))
        .collect()
}

/// The f16 gradients of a conv-BN-ReLU net are within 1e-2 (relative, Frobenius) of the fp32
/// ones, for 16 seeds of weights, inputs and loss weights.
///
/// The normalisation layers start with gamma 0.2 and beta 1 (`SeededInit`). With Burn's
/// defaults (gamma 1, beta 0) half the activations sit at ReLU's kink, and f16 rounding flips
/// a few of them from one side to the other; on these 6x6 maps a single flip moves a
/// channel's weight gradient by several percent. Over 200 seeds with those defaults, the stem
/// conv's f16 gradient was off by 1.1e-2 median and 0.36 at worst. Even fp32 arithmetic that
/// only rounds each conv's input and output to f16 was off by up to 0.28. That measures where
/// the kinks fall, not memsave's casts. With the margin, 200 seeds gave at most 4.5e-3.
#[test]
fn amp_gradients_match_fp32_within_1e_2() {
    let (mut best, mut worst) = (f32::INFINITY, 0.0_f32);
    for seed in 0..16 {
        for (name, error) in amp_errors(seed) {
            best = best.min(error);
            worst = worst.max(error);
            assert!(
                error < 1e-2,
                "seed {seed}, {name}: relative error of the f16 gradient {error}"
            );
            assert!(
                error > 0.0,
                "seed {seed}, {name}: the half run must really be half"
            );
        }
    }
    eprintln!("relative error of the f16 gradients over 16 seeds: {best:.2e} to {worst:.2e}");
}
