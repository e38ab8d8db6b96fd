//! memsave's lean layers on Burn 0.22 (`memsave_next::nn`): LayerNorm, GroupNorm and BatchNorm
//! as one node each, against Burn 0.22's own layers (outputs and gradients) under both of
//! Burn's checkpointing strategies; the fused ReLU; the ReLU that keeps its output; a half
//! input normalised in fp32; what each keeps for backward, measured by the counting
//! allocator; BatchNorm inside a checkpointed block.

use crate::common;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use common::{device, devices, watchdog};
use memsave_macros::{model, with_cp};
use memsave_next::checkpoint::set_with_cp;
use memsave_next::memory;
use memsave_next::nn::{relu, BatchNorm, BatchNormConfig, GroupNormConfig, LayerNormConfig};

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().iter::<f32>().collect()
}

/// The largest difference of `a` and `b`, relative to the larger magnitude (at least 1).
#[track_caller]
fn assert_close<const D: usize>(a: Tensor<D>, b: Tensor<D>, tolerance: f32, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let worst = values(a)
        .iter()
        .zip(values(b))
        .map(|(a, b)| (a - b).abs() / a.abs().max(b.abs()).max(1.0))
        .fold(0.0_f32, f32::max);
    assert!(worst <= tolerance, "{what}: {worst} over {tolerance}");
}

fn random<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.5, 2.0), device)
}

/// A random `[n]` parameter (not Burn's ones and zeros, which would hide a mixed-up gamma).
fn param(n: usize, device: &Device) -> Param<Tensor<1>> {
    Param::from_tensor(random([n], device))
}

#[test]
fn layer_norm_is_burns_output_and_gradients_under_both_strategies() {
    watchdog(120, || {
        for (name, device) in devices() {
            device.seed(1);
            let mut burn = burn::nn::LayerNormConfig::new(32).init(&device);
            burn.gamma = param(32, &device);
            burn.beta = Some(param(32, &device));
            let mut ours = LayerNormConfig::new(32).init(&device);
            ours.gamma = burn.gamma.clone();
            ours.beta = burn.beta.clone().unwrap();
            let x = random([4, 7, 32], &device).require_grad();
            let w = random([4, 7, 32], &device);
            for fused in [false, true] {
                let y_burn = match fused {
                    false => burn.forward(x.clone()),
                    true => burn::tensor::activation::relu(burn.forward(x.clone())),
                };
                let y_ours = match fused {
                    false => ours.forward(x.clone()),
                    true => ours.forward_relu(x.clone()),
                };
                let what = format!("{name}, relu {fused}");
                assert_close(
                    y_burn.clone(),
                    y_ours.clone(),
                    1e-5,
                    &format!("{what}: output"),
                );
                let g_burn = (y_burn * w.clone()).sum().backward();
                let g_ours = (y_ours * w.clone()).sum().backward();
                let (a, b) = (x.grad(&g_burn).unwrap(), x.grad(&g_ours).unwrap());
                assert_close(a, b, 1e-4, &format!("{what}: x"));
                let gamma = |g| burn.gamma.val().grad(g).unwrap();
                assert_close(
                    gamma(&g_burn),
                    gamma(&g_ours),
                    1e-4,
                    &format!("{what}: gamma"),
                );
                let beta = |g| burn.beta.as_ref().unwrap().val().grad(g).unwrap();
                assert_close(beta(&g_burn), beta(&g_ours), 1e-4, &format!("{what}: beta"));
            }
        }
    });
}

#[test]
fn group_norm_is_burns_output_and_gradients() {
    watchdog(120, || {
        for (name, device) in devices() {
            device.seed(2);
            let mut burn = burn::nn::GroupNormConfig::new(4, 8).init(&device);
            burn.gamma = Some(param(8, &device));
            burn.beta = Some(param(8, &device));
            let mut ours = GroupNormConfig::new(4, 8).init(&device);
            ours.gamma = burn.gamma.clone().unwrap();
            ours.beta = burn.beta.clone().unwrap();
            let x = random([2, 8, 5, 5], &device).require_grad();
            let w = random([2, 8, 5, 5], &device);
            let y_burn = burn.forward(x.clone());
            let y_ours = ours.forward(x.clone());
            assert_close(y_burn.clone(), y_ours.clone(), 1e-5, name);
            let g_burn = (y_burn * w.clone()).sum().backward();
            let g_ours = (y_ours * w).sum().backward();
            assert_close(
                x.grad(&g_burn).unwrap(),
                x.grad(&g_ours).unwrap(),
                1e-4,
                name,
            );
            let gamma = |g| ours.gamma.val().grad(g).unwrap();
            assert_close(gamma(&g_burn), gamma(&g_ours), 1e-4, name);
        }
    });
}

#[test]
fn batch_norm_is_burns_in_training_and_pytorchs_running_variance() {
    watchdog(120, || {
        for (name, device) in devices() {
            device.seed(3);
            let mut burn = burn::nn::BatchNormConfig::new(6).init(&device);
            burn.gamma = param(6, &device);
            burn.beta = param(6, &device);
            let mut ours = BatchNormConfig::new(6).init(&device);
            ours.gamma = burn.gamma.clone();
            ours.beta = burn.beta.clone();
            let x = random([5, 6, 3, 4], &device).require_grad();
            let w = random([5, 6, 3, 4], &device);
            for fused in [false, true] {
                let y_burn = match fused {
                    false => burn.forward(x.clone()),
                    true => burn::tensor::activation::relu(burn.forward(x.clone())),
                };
                let y_ours = match fused {
                    false => ours.forward(x.clone()),
                    true => ours.forward_relu(x.clone()),
                };
                let what = format!("{name}, relu {fused}");
                assert_close(y_burn.clone(), y_ours.clone(), 1e-5, &what);
                let g_burn = (y_burn * w.clone()).sum().backward();
                let g_ours = (y_ours * w.clone()).sum().backward();
                assert_close(
                    x.grad(&g_burn).unwrap(),
                    x.grad(&g_ours).unwrap(),
                    1e-4,
                    &what,
                );
                let beta = |g| ours.beta.val().grad(g).unwrap();
                assert_close(beta(&g_burn), beta(&g_ours), 1e-4, &what);
            }
            // Two updates of the running statistics, each from this batch: the mean as Burn's,
            // the variance PyTorch's (unbiased: times n / (n - 1), n = 5 * 3 * 4).
            assert_close(
                burn.running_mean.value_sync(),
                ours.running_mean.value_sync(),
                1e-6,
                "running mean",
            );
            let (var, _) = x
                .clone()
                .detach()
                .swap_dims(0, 1)
                .reshape([6, 60])
                .var_mean_bias(1);
            let unbiased = var.reshape([6]).mul_scalar(60.0 / 59.0);
            let expected = Tensor::<1>::ones([6], &device)
                .mul_scalar(0.81)
                .add(unbiased.mul_scalar(0.1 * 0.9 + 0.1));
            assert_close(
                expected,
                ours.running_var.value_sync(),
                1e-5,
                "running variance",
            );
            // Eval mode: the running statistics normalise and stay.
            let eval = ours.clone().with_eval(true);
            let (mean, var) = (
                ours.running_mean.value_sync(),
                ours.running_var.value_sync(),
            );
            let by_hand = (x.clone() - mean.clone().reshape([1, 6, 1, 1]))
                / var.clone().add_scalar(1e-5).sqrt().reshape([1, 6, 1, 1])
                * ours.gamma.val().reshape([1, 6, 1, 1])
                + ours.beta.val().reshape([1, 6, 1, 1]);
            assert_close(by_hand, eval.forward(x.clone()), 1e-5, "eval");
            assert_close(
                mean,
                eval.running_mean.value_sync(),
                0.0,
                "eval leaves the mean",
            );
        }
    });
}

#[test]
fn the_relu_keeps_its_output_and_has_burns_gradient_bit_for_bit() {
    watchdog(120, || {
        let device = device();
        device.seed(4);
        // Exact zeros too: both masks take x <= 0 as off.
        let x = random([64, 1024], &device)
            .mask_fill(random([64, 1024], &device).lower_elem(-2.0), 0.0)
            .require_grad();
        let w = random([64, 1024], &device);
        let g_burn = (burn::tensor::activation::relu(x.clone()) * w.clone())
            .sum()
            .backward();
        let g_ours = (relu(x.clone()) * w.clone()).sum().backward();
        assert_eq!(
            common::bits(x.grad(&g_burn).unwrap()),
            common::bits(x.grad(&g_ours).unwrap())
        );
        // What each keeps: Burn's ReLU its input (alive beside the output the next op keeps),
        // ours its output (which the next op keeps anyway: the input is freed).
        let meter = memory::meter_for(&device).unwrap();
        let kept = |ours: bool| {
            let x = random([64, 1024], &device).require_grad().mul_scalar(1.0);
            let before = meter.live();
            let y = if ours {
                relu(x)
            } else {
                burn::tensor::activation::relu(x)
            };
            let loss = (y.clone() * y).sum();
            let kept = meter.live() as i64 - before as i64;
            drop(loss);
            kept
        };
        let (burn, ours) = (kept(false), kept(true));
        println!("bytes a relu and the product of its output add: Burn's {burn}, ours {ours}");
        // The input, 256 KiB, is what Burn's keeps more.
        assert!(burn - ours >= 64 * 1024 * 4, "Burn's {burn}, ours {ours}");
    });
}

#[test]
fn a_half_input_is_normalised_in_fp32() {
    watchdog(120, || {
        let device = device();
        device.seed(5);
        let ln = LayerNormConfig::new(64).init(&device);
        // Rows of large mean and spread: f16 statistics would lose them.
        let x = random([16, 64], &device)
            .mul_scalar(300.0)
            .add_scalar(2000.0);
        let expected = ln.forward(x.clone());
        let half = x.cast(DType::F16).require_grad();
        let y = ln.forward(half.clone());
        assert_eq!(y.dtype(), DType::F16, "the input's type");
        let reference = ln.forward(half.clone().cast(DType::F32));
        assert_close(
            reference,
            y.clone().cast(DType::F32),
            2e-3,
            "f16 against fp32 on the same input",
        );
        assert_close(
            expected,
            y.clone().cast(DType::F32),
            2e-2,
            "f16 against the fp32 input",
        );
        let grads = y.cast(DType::F32).sum().backward();
        let g = half.grad(&grads).unwrap();
        assert_eq!(g.dtype(), DType::F16);
        assert!(values(g).iter().all(|v| v.is_finite()));
    });
}

#[test]
fn each_norm_keeps_its_input_and_its_statistics_alone() {
    watchdog(120, || {
        let device = device();
        let meter = memory::meter_for(&device).unwrap();
        let input_bytes = (64 * 128 * 256 * 4) as i64;
        // Bytes live once the output is consumed and dropped, before backward.
        let kept = |which: &str| -> i64 {
            device.seed(6);
            let x = random([64, 128, 256], &device)
                .require_grad()
                .mul_scalar(1.0);
            let before = meter.live() as i64;
            let y = match which {
                "burn layer" => burn::nn::LayerNormConfig::new(256).init(&device).forward(x),
                "ours layer" => LayerNormConfig::new(256).init(&device).forward(x),
                "burn group" => burn::nn::GroupNormConfig::new(8, 128)
                    .init(&device)
                    .forward(x),
                "ours group" => GroupNormConfig::new(8, 128).init(&device).forward(x),
                _ => unreachable!(),
            };
            let loss = y.sum();
            let kept = meter.live() as i64 - before;
            drop(loss);
            kept
        };
        for layer in ["layer", "group"] {
            let burn = kept(&format!("burn {layer}"));
            let ours = kept(&format!("ours {layer}"));
            println!(
                "{layer} norm keeps beside its input ({input_bytes} bytes): Burn's {burn}, ours {ours}"
            );
            // Ours: the statistics and the parameters; Burn's: activation-sized tensors.
            assert!(ours < input_bytes / 8, "{layer}: ours kept {ours}");
            assert!(burn > input_bytes, "{layer}: Burn's kept {burn}");
        }
    });
}

/// A block whose BatchNorm runs inside the segment.
#[model]
#[derive(Module, Debug)]
struct Block {
    fc: Linear,
    bn: BatchNorm,
    out: Linear,
    with_cp: bool,
}

impl Block {
    #[with_cp]
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(self.bn.forward_relu(self.fc.forward(x)))
    }
}

#[test]
fn batch_norm_in_a_checkpointed_block_moves_its_statistics_once_and_has_the_plain_gradients() {
    watchdog(120, || {
        for (name, device) in devices() {
            // Each run a model of its own: a running state is shared by every clone.
            let make = || {
                device.seed(7);
                common::initialized(Block {
                    fc: LinearConfig::new(8, 16).init(&device),
                    bn: BatchNormConfig::new(16).init(&device),
                    out: LinearConfig::new(16, 4).init(&device),
                    with_cp: false,
                })
            };
            let x = random([12, 8], &device).require_grad();
            let step = |block: &Block| {
                let grads = block.forward(x.clone()).powi_scalar(2).mean().backward();
                let stats = (
                    common::bits(block.bn.running_mean.value_sync()),
                    common::bits(block.bn.running_var.value_sync()),
                );
                (common::grad_bits(block, &grads), stats)
            };
            let (plain, plain_stats) = step(&make());
            let checkpointed = set_with_cp(make(), true);
            let (ours, stats) = step(&checkpointed);
            common::assert_same_bits(&plain, &ours, name);
            assert_eq!(
                plain_stats, stats,
                "{name}: the running statistics moved once"
            );
        }
    });
}

#[test]
fn batch_norm_relu_conv_is_the_two_steps_and_keeps_only_its_input() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::PaddingConfig2d;
    watchdog(120, || {
        for (name, device) in devices() {
            for (kernel, padding, bias) in [
                (3, PaddingConfig2d::Explicit(1, 1, 1, 1), true),
                // An even kernel: Burn's `Same` pads one side more.
                (2, PaddingConfig2d::Same, false),
            ] {
                device.seed(8);
                let mut bn = BatchNormConfig::new(6).init(&device);
                bn.gamma = param(6, &device);
                bn.beta = param(6, &device);
                let conv = common::initialized(
                    Conv2dConfig::new([6, 5], [kernel, kernel])
                        .with_padding(padding.clone())
                        .with_bias(bias)
                        .init(&device),
                );
                let x = random([3, 6, 7, 7], &device).require_grad();
                let two_steps = bn.clone().forward_relu(x.clone());
                let two_steps = conv.forward(two_steps);
                let fused = bn.forward_relu_conv(x.clone(), &conv);
                let what = format!("{name}, kernel {kernel}");
                assert_close(
                    two_steps.clone(),
                    fused.clone(),
                    1e-5,
                    &format!("{what}: output"),
                );
                let w = random(fused.dims(), &device);
                let g_two = (two_steps * w.clone()).sum().backward();
                let g_fused = (fused * w).sum().backward();
                let x_grad = |g| x.grad(g).unwrap();
                assert_close(
                    x_grad(&g_two),
                    x_grad(&g_fused),
                    1e-4,
                    &format!("{what}: x"),
                );
                let gamma = |g| bn.gamma.val().grad(g).unwrap();
                assert_close(
                    gamma(&g_two),
                    gamma(&g_fused),
                    1e-4,
                    &format!("{what}: gamma"),
                );
                let weight = |g| conv.weight.val().grad(g).unwrap();
                assert_close(
                    weight(&g_two),
                    weight(&g_fused),
                    1e-4,
                    &format!("{what}: weight"),
                );
                if bias {
                    let b = |g| conv.bias.as_ref().unwrap().val().grad(g).unwrap();
                    assert_close(b(&g_two), b(&g_fused), 1e-4, &format!("{what}: bias"));
                }
            }
        }
        // What each keeps before backward beyond its input: the two steps the ReLU's output
        // (the convolution's input), the fused op the statistics alone.
        let device = device();
        let meter = memory::meter_for(&device).unwrap();
        let conv = Conv2dConfig::new([32, 32], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(&device);
        let bn = BatchNormConfig::new(32).init(&device);
        let kept = |fused: bool| {
            let x = random([8, 32, 64, 64], &device)
                .require_grad()
                .mul_scalar(1.0);
            let before = meter.live() as i64;
            let y = match fused {
                true => bn.forward_relu_conv(x, &conv),
                false => conv.forward(bn.forward_relu(x)),
            };
            let loss = y.sum();
            let kept = meter.live() as i64 - before;
            drop(loss);
            kept
        };
        let (two, fused) = (kept(false), kept(true));
        let activation = (8 * 32 * 64 * 64 * 4) as i64;
        println!("BatchNorm-ReLU-conv keeps beside its input ({activation} bytes): two steps {two}, fused {fused}");
        assert!(
            two - fused >= activation * 9 / 10,
            "two steps {two}, fused {fused}"
        );
    });
}
