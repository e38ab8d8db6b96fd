//! memsave's lean operations (one autodiff node each, hand-written backward: the norms, ReLU,
//! the convolution's weight gradient, max pooling) against
//! references: the composition of Burn tensor ops that memsave used before (gradients within
//! 1e-5), a finite-difference check in f64 (1e-5 relative), the generic tensor-op kernels that
//! CUDA runs (Flex's fused loops must agree), and half inputs against fp32.

use crate::common;

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::prelude::*;
use burn::tensor::DType;
use common::{max_relative_difference, splitmix64, values};
use memsave::nn::kernels::{generic, Act, Grouping, NormKernels, View, Wanted};
use memsave::nn::{relu, BatchNormConfig, GroupNormConfig, LayerNormConfig};

type AB = Autodiff<Flex>;

/// Seeded normal draws (Box-Muller over splitmix64), scaled and shifted.
fn draws(n: usize, seed: u64, scale: f32, shift: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            let u = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            let v = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            let z = (-2.0 * u.max(1e-12).ln()).sqrt() * (std::f64::consts::TAU * v).cos();
            z as f32 * scale + shift
        })
        .collect()
}

fn tensor<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<AB, D> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// The composition memsave's BatchNorm was before (Burn ops; Burn differentiates it).
fn composed_batch_norm(
    x: Tensor<AB, 4>,
    gamma: Tensor<AB, 1>,
    beta: Tensor<AB, 1>,
    relu_after: bool,
) -> Tensor<AB, 4> {
    let [n, c, h, w] = x.dims();
    let rows = x.clone().swap_dims(0, 1).reshape([c, n * h * w]);
    let mean = rows.clone().mean_dim(1).reshape([1, c, 1, 1]);
    let var = rows
        .sub(mean.clone().reshape([c, 1]))
        .square()
        .mean_dim(1)
        .reshape([1, c, 1, 1]);
    let y =
        (x - mean) / (var + 1e-5).sqrt() * gamma.reshape([1, c, 1, 1]) + beta.reshape([1, c, 1, 1]);
    if relu_after {
        burn::tensor::activation::relu(y)
    } else {
        y
    }
}

struct Case {
    shape: [usize; 4],
    seed: u64,
}

const CASES: [Case; 3] = [
    Case {
        shape: [2, 3, 4, 5],
        seed: 1,
    },
    Case {
        shape: [4, 8, 7, 7],
        seed: 2,
    },
    Case {
        shape: [1, 5, 3, 3],
        seed: 3,
    },
];

/// Gradients of `sum(w * f(x))` for x, gamma and beta.
fn grads_of(
    f: impl Fn(Tensor<AB, 4>, Tensor<AB, 1>, Tensor<AB, 1>) -> Tensor<AB, 4>,
    case: &Case,
) -> [Vec<f32>; 4] {
    let numel: usize = case.shape.iter().product();
    let c = case.shape[1];
    let x = tensor(draws(numel, case.seed, 2.0, 0.5), case.shape).require_grad();
    let gamma = tensor(draws(c, case.seed + 10, 0.5, 1.0), [c]).require_grad();
    let beta = tensor(draws(c, case.seed + 20, 0.5, 0.1), [c]).require_grad();
    let w = tensor(draws(numel, case.seed + 30, 1.0, 0.0), case.shape);
    let y = f(x.clone(), gamma.clone(), beta.clone());
    let out = values(y.clone().inner());
    let grads = (y * w).sum().backward();
    [
        out,
        values(x.grad(&grads).unwrap()),
        values(gamma.grad(&grads).unwrap()),
        values(beta.grad(&grads).unwrap()),
    ]
}

fn memsave_batch_norm(
    relu_after: bool,
) -> impl Fn(Tensor<AB, 4>, Tensor<AB, 1>, Tensor<AB, 1>) -> Tensor<AB, 4> {
    move |x, gamma, beta| {
        let c = x.dims()[1];
        let mut bn = BatchNormConfig::new(c).init::<AB>(&Default::default());
        bn.gamma = Param::from_tensor(gamma);
        bn.beta = Param::from_tensor(beta);
        // The parameters are the caller's leaves: use them as they are.
        if relu_after {
            bn.forward_relu(x)
        } else {
            bn.forward(x)
        }
    }
}

#[test]
fn batch_norm_matches_the_composed_version_within_1e_5() {
    let mut worst = 0.0f32;
    for relu_after in [false, true] {
        for case in &CASES {
            let ours = grads_of(memsave_batch_norm(relu_after), case);
            let reference = grads_of(|x, g, b| composed_batch_norm(x, g, b, relu_after), case);
            for (what, (a, b)) in ["output", "dx", "dgamma", "dbeta"]
                .iter()
                .zip(ours.iter().zip(&reference))
            {
                let d = max_relative_difference(a, b);
                assert!(
                    d <= 1e-5,
                    "{what}, {:?}, relu {relu_after}: {d}",
                    case.shape
                );
                worst = worst.max(d);
            }
        }
    }
    eprintln!("BatchNorm vs composed: max relative difference {worst:e}");
}

/// f64 reference of `sum(w * bn(x))` for finite differences.
fn reference_loss(
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    w: &[f64],
    shape: [usize; 4],
    relu_after: bool,
) -> f64 {
    let [n, c, h, wd] = shape;
    let s = h * wd;
    let mut loss = 0.0;
    for ch in 0..c {
        let idx = |b: usize, i: usize| (b * c + ch) * s + i;
        let m = n * s;
        let mean: f64 = (0..n)
            .flat_map(|b| (0..s).map(move |i| (b, i)))
            .map(|(b, i)| x[idx(b, i)])
            .sum::<f64>()
            / m as f64;
        let var: f64 = (0..n)
            .flat_map(|b| (0..s).map(move |i| (b, i)))
            .map(|(b, i)| (x[idx(b, i)] - mean).powi(2))
            .sum::<f64>()
            / m as f64;
        for b in 0..n {
            for i in 0..s {
                let mut y = (x[idx(b, i)] - mean) / (var + 1e-5).sqrt() * gamma[ch] + beta[ch];
                if relu_after {
                    y = y.max(0.0);
                }
                loss += w[idx(b, i)] * y;
            }
        }
    }
    loss
}

#[test]
fn batch_norm_gradients_pass_a_finite_difference_check_within_1e_5() {
    let mut worst = 0.0f64;
    for relu_after in [false, true] {
        let case = &CASES[0];
        let numel: usize = case.shape.iter().product();
        let c = case.shape[1];
        let [_, dx, dgamma, dbeta] = grads_of(memsave_batch_norm(relu_after), case);
        let to64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
        let x = to64(draws(numel, case.seed, 2.0, 0.5));
        let gamma = to64(draws(c, case.seed + 10, 0.5, 1.0));
        let beta = to64(draws(c, case.seed + 20, 0.5, 0.1));
        let w = to64(draws(numel, case.seed + 30, 1.0, 0.0));
        let h = 1e-6;
        let check = |analytic: &[f32], which: usize| -> f64 {
            let len = analytic.len();
            let mut numeric = vec![0.0; len];
            for i in 0..len {
                let mut args = [x.clone(), gamma.clone(), beta.clone()];
                args[which][i] += h;
                let up = reference_loss(&args[0], &args[1], &args[2], &w, case.shape, relu_after);
                args[which][i] -= 2.0 * h;
                let down = reference_loss(&args[0], &args[1], &args[2], &w, case.shape, relu_after);
                numeric[i] = (up - down) / (2.0 * h);
            }
            let scale = numeric.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            analytic
                .iter()
                .zip(&numeric)
                .map(|(a, n)| (*a as f64 - n).abs() / scale)
                .fold(0.0, f64::max)
        };
        for (what, d) in [
            ("dx", check(&dx, 0)),
            ("dgamma", check(&dgamma, 1)),
            ("dbeta", check(&dbeta, 2)),
        ] {
            assert!(d <= 1e-5, "{what}, relu {relu_after}: {d}");
            worst = worst.max(d);
        }
    }
    eprintln!("BatchNorm vs finite differences (f64): max relative difference {worst:e}");
}

#[test]
fn half_inputs_stay_half_and_agree_with_fp32() {
    for dtype in [DType::F16, DType::BF16] {
        let case = &CASES[1];
        let numel: usize = case.shape.iter().product();
        let c = case.shape[1];
        let tolerance = if dtype == DType::F16 { 5e-3 } else { 3e-2 };
        let run = |half: bool| {
            let x = tensor(draws(numel, 5, 2.0, 0.5), case.shape);
            let x = if half { x.cast(dtype) } else { x }.require_grad();
            let bn = BatchNormConfig::new(c).init::<AB>(&Default::default());
            let y = bn.forward_relu(x.clone());
            assert_eq!(y.dtype(), if half { dtype } else { DType::F32 });
            let w = tensor(draws(numel, 6, 1.0, 0.0), case.shape);
            let grads = (y.clone().cast(DType::F32) * w).sum().backward();
            let dx = x.grad(&grads).unwrap();
            assert_eq!(dx.dtype(), if half { dtype } else { DType::F32 });
            (
                values(y.inner()),
                values(dx),
                values(bn.gamma.val().grad(&grads).unwrap()),
            )
        };
        let (y16, dx16, dg16) = run(true);
        let (y32, dx32, dg32) = run(false);
        for (what, a, b) in [
            ("output", &y16, &y32),
            ("dx", &dx16, &dx32),
            ("dgamma", &dg16, &dg32),
        ] {
            let d = max_relative_difference(a, b);
            assert!(d <= tolerance, "{dtype:?} {what}: {d}");
        }
    }
}

/// Flex's fused loops and the tensor-op kernels CUDA runs, on the same inputs.
#[test]
fn flex_kernels_agree_with_the_generic_ones() {
    let cases = [
        (
            View {
                outer: 3,
                channels: 6,
                inner: 10,
            },
            Grouping::PerChannel,
        ),
        (
            View {
                outer: 3,
                channels: 6,
                inner: 10,
            },
            Grouping::PerSampleGroup { groups: 3 },
        ),
        (
            View {
                outer: 7,
                channels: 1,
                inner: 12,
            },
            Grouping::PerRow,
        ),
    ];
    for (view, grouping) in cases {
        for act in [Act::Identity, Act::Relu] {
            let numel = view.outer * view.channels * view.inner;
            let affine = view.affine(grouping);
            let t = |v: Vec<f32>, n: usize| {
                Tensor::<Flex, 1>::from_data(TensorData::new(v, [n]), &Default::default())
                    .into_primitive()
                    .tensor()
            };
            let x = t(draws(numel, 11, 3.0, 1.0), numel);
            let dy = t(draws(numel, 12, 1.0, 0.0), numel);
            let gamma = t(draws(affine, 13, 0.5, 1.0), affine);
            let beta = t(draws(affine, 14, 0.5, 0.2), affine);
            let (mean, var) = Flex::norm_stats(&x, view, grouping);
            let (gmean, gvar) = generic::stats::<Flex>(&x, view, grouping);
            let f = |t: burn::tensor::ops::FloatTensor<Flex>| {
                values(Tensor::<Flex, 1>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(t),
                ))
            };
            assert!(max_relative_difference(&f(mean.clone()), &f(gmean)) <= 1e-5);
            assert!(max_relative_difference(&f(var.clone()), &f(gvar)) <= 1e-5);
            let invstd =
                Tensor::<Flex, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(var))
                    .add_scalar(1e-5)
                    .sqrt()
                    .recip()
                    .into_primitive()
                    .tensor();
            let y = Flex::norm_apply(
                x.clone(),
                view,
                grouping,
                &mean,
                &invstd,
                &gamma,
                &beta,
                act,
            );
            let gy = generic::apply::<Flex>(
                x.clone(),
                view,
                grouping,
                &mean,
                &invstd,
                &gamma,
                &beta,
                act,
            );
            let d = max_relative_difference(&f(y), &f(gy));
            assert!(d <= 1e-5, "apply {grouping:?} {act:?}: {d}");
            for batch_stats in [true, false] {
                let wanted = Wanted {
                    input: true,
                    affine: true,
                    batch_stats,
                };
                let (dx, dg, db) = Flex::norm_backward(
                    &x,
                    dy.clone(),
                    view,
                    grouping,
                    &mean,
                    &invstd,
                    &gamma,
                    &beta,
                    act,
                    wanted,
                );
                let (gdx, gdg, gdb) = generic::backward::<Flex>(
                    &x,
                    dy.clone(),
                    view,
                    grouping,
                    &mean,
                    &invstd,
                    &gamma,
                    &beta,
                    act,
                    wanted,
                );
                for (what, a, b) in [("dx", dx, gdx), ("dgamma", dg, gdg), ("dbeta", db, gdb)] {
                    let d = max_relative_difference(&f(a.unwrap()), &f(b.unwrap()));
                    assert!(
                        d <= 1e-5,
                        "{what} {grouping:?} {act:?} batch {batch_stats}: {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn group_norm_and_layer_norm_match_their_compositions() {
    let device = Default::default();
    // GroupNorm: [2, 6, 3, 4] in 3 groups.
    let x0 = draws(144, 21, 2.0, 0.3);
    let w = tensor(draws(144, 22, 1.0, 0.0), [2, 6, 3, 4]);
    let gn = GroupNormConfig::new(3, 6).init::<AB>(&device);
    let run = |composed: bool| {
        let x = tensor(x0.clone(), [2, 6, 3, 4]).require_grad();
        let y = if composed {
            let rows = x.clone().reshape([2, 3, 24]);
            let mean = rows.clone().mean_dim(2);
            let centred = rows - mean;
            let var = centred.clone().square().mean_dim(2);
            let normalised = (centred / (var + 1e-5).sqrt()).reshape([2, 6, 3, 4]);
            normalised * gn.gamma.val().reshape([1, 6, 1, 1]) + gn.beta.val().reshape([1, 6, 1, 1])
        } else {
            gn.forward(x.clone())
        };
        let grads = (y.clone() * w.clone()).sum().backward();
        (
            values(y.inner()),
            values(x.grad(&grads).unwrap()),
            values(gn.gamma.val().grad(&grads).unwrap()),
        )
    };
    let (a, b) = (run(false), run(true));
    assert!(max_relative_difference(&a.0, &b.0) <= 1e-5);
    assert!(max_relative_difference(&a.1, &b.1) <= 1e-5);
    assert!(max_relative_difference(&a.2, &b.2) <= 1e-5);

    // LayerNorm over the last dimension of [3, 5, 8].
    let x0 = draws(120, 31, 50.0, 10.0);
    let w = tensor(draws(120, 32, 1.0, 0.0), [3, 5, 8]);
    let ln = LayerNormConfig::new(8).init::<AB>(&device);
    let run = |composed: bool| {
        let x = tensor(x0.clone(), [3, 5, 8]).require_grad();
        let y = if composed {
            let mean = x.clone().mean_dim(2);
            let centred = x.clone() - mean;
            let var = centred.clone().square().mean_dim(2);
            centred / (var + 1e-5).sqrt() * ln.gamma.val().reshape([1, 1, 8])
                + ln.beta.val().reshape([1, 1, 8])
        } else {
            ln.forward(x.clone())
        };
        let grads = (y.clone() * w.clone()).sum().backward();
        (
            values(y.inner()),
            values(x.grad(&grads).unwrap()),
            values(ln.gamma.val().grad(&grads).unwrap()),
        )
    };
    let (a, b) = (run(false), run(true));
    assert!(max_relative_difference(&a.0, &b.0) <= 1e-5);
    assert!(max_relative_difference(&a.1, &b.1) <= 1e-5);
    assert!(max_relative_difference(&a.2, &b.2) <= 1e-5);
}

#[test]
fn layer_norm_on_f16_inputs_with_large_deviations_loses_nothing() {
    // Burn's LayerNorm under Autodiff<Flex> in f16 zeroes rows whose |x - mean| exceeds ~256.
    let ln = LayerNormConfig::new(256).init::<AB>(&Default::default());
    let x = tensor(draws(512, 41, 300.0, 0.0), [2, 256]);
    let y32 = values(ln.forward(x.clone()).inner());
    let y16 = values(ln.forward(x.cast(DType::F16)).inner());
    let zeros = y16.iter().filter(|v| **v == 0.0).count();
    assert_eq!(zeros, 0, "{zeros} outputs are exactly 0");
    assert!(max_relative_difference(&y16, &y32) <= 2e-3);
}

#[test]
fn relu_keeping_its_output_has_burns_gradient() {
    let x0 = draws(60, 51, 1.0, 0.0);
    let w = tensor(draws(60, 52, 1.0, 0.0), [3, 20]);
    let run = |ours: bool| {
        let x = tensor(x0.clone(), [3, 20]).require_grad();
        let y = if ours {
            relu(x.clone())
        } else {
            burn::tensor::activation::relu(x.clone())
        };
        let grads = (y * w.clone()).sum().backward();
        values(x.grad(&grads).unwrap())
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn batch_norm_in_eval_mode_uses_the_running_statistics() {
    let device = Default::default();
    let mut bn = BatchNormConfig::new(3).init::<Flex>(&device);
    bn.running_mean =
        burn::module::RunningState::new(Tensor::from_floats([1.0, -2.0, 0.5], &device));
    bn.running_var =
        burn::module::RunningState::new(Tensor::from_floats([4.0, 0.25, 1.0], &device));
    let x = Tensor::<Flex, 4>::from_floats([[[[3.0]], [[-1.0]], [[0.5]]]], &device);
    let y = bn.forward(x).into_data().to_vec::<f32>().unwrap();
    let expect = [
        2.0 / (4.0f32 + 1e-5).sqrt(),
        1.0 / (0.25f32 + 1e-5).sqrt(),
        0.0,
    ];
    for (a, b) in y.iter().zip(expect) {
        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
    }
}

/// The convolution with memsave's weight gradient against Burn's, on the shapes a ResNet has
/// (1x1, 3x3, strided, padded, the 7x7 stem, with and without bias) and one with dilation.
#[test]
fn conv2d_gradients_match_burns() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::PaddingConfig2d;
    let device = Default::default();
    let cases = [
        (2, 8, 16, 1, 9, 1, 0, 1, false),
        (2, 8, 8, 3, 9, 1, 1, 1, true),
        (2, 8, 16, 3, 10, 2, 1, 1, false),
        (2, 16, 8, 1, 10, 2, 0, 1, false),
        (1, 3, 8, 7, 20, 2, 3, 1, false),
        (2, 4, 4, 3, 11, 1, 2, 2, true),
        // Large enough for the input gradient's per-sample split into blocks of rows (the
        // cases above take its small path): 2 x 144 x 1720 im2col elements, 144 > 128 rows.
        (2, 16, 8, 3, 40, 1, 1, 1, false),
        (2, 160, 8, 1, 40, 1, 0, 1, true),
    ];
    let mut worst = 0.0f32;
    for (i, &(n, cin, cout, k, hw, stride, pad, dilation, bias)) in cases.iter().enumerate() {
        let conv = Conv2dConfig::new([cin, cout], [k, k])
            .with_stride([stride, stride])
            .with_dilation([dilation, dilation])
            .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
            .with_bias(bias)
            .init::<AB>(&device);
        // Wider than high: rows and columns are not interchangeable.
        let numel = n * cin * hw * (hw + 3);
        let x0 = draws(numel, 60 + i as u64, 1.0, 0.0);
        let run = |ours: bool| {
            let x = tensor(x0.clone(), [n, cin, hw, hw + 3]).require_grad();
            let y = if ours {
                memsave::nn::conv2d(&conv, x.clone())
            } else {
                conv.forward(x.clone())
            };
            let w = y.clone().detach().sin();
            let grads = (y.clone() * w).sum().backward();
            let mut out = vec![
                values(y.inner()),
                values(x.grad(&grads).unwrap()),
                values(conv.weight.grad(&grads).unwrap()),
            ];
            if let Some(b) = &conv.bias {
                out.push(values(b.grad(&grads).unwrap()));
            }
            out
        };
        let (ours, burns) = (run(true), run(false));
        for (what, (a, b)) in ["y", "dx", "dw", "db"].iter().zip(ours.iter().zip(&burns)) {
            let d = max_relative_difference(a, b);
            assert!(d <= 1e-5, "case {i} {what}: {d}");
            worst = worst.max(d);
        }
    }
    eprintln!("conv2d vs Burn's: max relative difference {worst:e}");
}

#[test]
fn max_pool_keeping_only_indices_has_burns_gradient() {
    use burn::nn::pool::MaxPool2dConfig;
    use burn::nn::PaddingConfig2d;
    let pool = MaxPool2dConfig::new([3, 3])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init();
    for dtype in [DType::F32, DType::F16] {
        let x0 = draws(2 * 3 * 9 * 9, 71, 1.0, 0.0);
        let run = |ours: bool| {
            let x = tensor(x0.clone(), [2, 3, 9, 9]).cast(dtype).require_grad();
            let y = if ours {
                memsave::nn::max_pool2d(&pool, x.clone())
            } else {
                pool.forward(x.clone())
            };
            let w = tensor(draws(2 * 3 * 5 * 5, 72, 1.0, 0.0), [2, 3, 5, 5]).cast(dtype);
            let grads = (y.clone() * w).sum().backward();
            (values(y.inner()), values(x.grad(&grads).unwrap()))
        };
        assert_eq!(run(true), run(false), "{dtype:?}");
    }
}

/// BN-ReLU and the convolution after it as one op that keeps only the BN's input: the same
/// output and gradients (input, BN's and the convolution's parameters) as the two steps.
#[test]
fn fused_bn_relu_conv_matches_the_separate_steps() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::PaddingConfig2d;
    let device = Default::default();
    let mut worst = 0.0f32;
    for (k, stride, bias) in [(1, 1, false), (3, 1, true), (3, 2, false)] {
        let conv = Conv2dConfig::new([6, 5], [k, k])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(k / 2, k / 2, k / 2, k / 2))
            .with_bias(bias)
            .init::<AB>(&device);
        let x0 = draws(2 * 6 * 7 * 7, 80 + k as u64, 2.0, 0.3);
        let run = |fused: bool| {
            let mut bn = memsave::nn::BatchNormConfig::new(6).init::<AB>(&device);
            bn.gamma = Param::from_tensor(tensor(draws(6, 81, 0.5, 1.0), [6]).require_grad());
            bn.beta = Param::from_tensor(tensor(draws(6, 82, 0.5, 0.1), [6]).require_grad());
            let x = tensor(x0.clone(), [2, 6, 7, 7]).require_grad();
            let y = if fused {
                bn.forward_relu_conv(x.clone(), &conv)
            } else {
                memsave::nn::conv2d(&conv, bn.forward_relu(x.clone()))
            };
            let w = y.clone().detach().cos();
            let grads = (y.clone() * w).sum().backward();
            let mut out = vec![
                values(y.inner()),
                values(x.grad(&grads).unwrap()),
                values(bn.gamma.val().grad(&grads).unwrap()),
                values(bn.beta.val().grad(&grads).unwrap()),
                values(conv.weight.grad(&grads).unwrap()),
                values(bn.running_mean.value_sync().inner()),
                values(bn.running_var.value_sync().inner()),
            ];
            if let Some(b) = &conv.bias {
                out.push(values(b.grad(&grads).unwrap()));
            }
            out
        };
        let (fused, separate) = (run(true), run(false));
        let names = [
            "y",
            "dx",
            "dgamma",
            "dbeta",
            "dw",
            "running mean",
            "running var",
            "db",
        ];
        for (what, (a, b)) in names.iter().zip(fused.iter().zip(&separate)) {
            let d = max_relative_difference(a, b);
            assert!(d <= 1e-5, "k{k} s{stride} {what}: {d}");
            worst = worst.max(d);
        }
    }
    eprintln!("fused BN-ReLU-conv vs separate: max relative difference {worst:e}");
}

/// The values and gradients of a conv-BN chain, for comparing two ways of running it.
fn conv_bn_outputs(
    y: &Tensor<AB, 4>,
    x: &Tensor<AB, 4>,
    bn: &memsave::nn::BatchNorm<AB>,
    conv: Option<&burn::nn::conv::Conv2d<AB>>,
) -> Vec<Vec<f32>> {
    let w = y.clone().detach().cos();
    let grads = (y.clone() * w).sum().backward();
    let mut out = vec![
        values(y.clone().inner()),
        values(x.grad(&grads).unwrap()),
        values(bn.gamma.val().grad(&grads).unwrap()),
        values(bn.beta.val().grad(&grads).unwrap()),
        values(bn.running_mean.value_sync().inner()),
        values(bn.running_var.value_sync().inner()),
    ];
    if let Some(conv) = conv {
        out.push(values(conv.weight.grad(&grads).unwrap()));
        if let Some(b) = &conv.bias {
            out.push(values(b.grad(&grads).unwrap()));
        }
    }
    out
}

fn bn_with_params(channels: usize, eval: bool) -> memsave::nn::BatchNorm<AB> {
    let device = Default::default();
    let mut bn = memsave::nn::BatchNormConfig::new(channels).init::<AB>(&device);
    bn.gamma = Param::from_tensor(tensor(draws(channels, 91, 0.5, 1.0), [channels]).require_grad());
    bn.beta = Param::from_tensor(tensor(draws(channels, 92, 0.5, 0.1), [channels]).require_grad());
    if eval {
        bn.running_mean =
            burn::module::RunningState::new(tensor(draws(channels, 93, 0.3, 0.0), [channels]));
        bn.running_var =
            burn::module::RunningState::new(tensor(draws(channels, 94, 0.2, 1.0), [channels]));
    }
    bn.with_eval(eval)
}

/// A convolution and the BN after it as one op that keeps only the convolution's input (the
/// convolution recomputed in backward): the same bits as the two steps, for the output, every
/// gradient and the running statistics, in training and eval mode, with and without bias, at
/// strides 1 and 2.
#[test]
fn conv_then_bn_keeping_the_input_equals_the_two_steps() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::PaddingConfig2d;
    let device = Default::default();
    for (k, stride, bias, eval) in [
        (1, 2, false, false),
        (1, 1, true, false),
        (3, 2, true, true),
        (3, 1, false, true),
    ] {
        let conv = Conv2dConfig::new([5, 6], [k, k])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(k / 2, k / 2, k / 2, k / 2))
            .with_bias(bias)
            .init::<AB>(&device);
        let x0 = draws(2 * 5 * 9 * 8, 95 + k as u64, 1.5, 0.2);
        let run = |fused: bool| {
            let bn = bn_with_params(6, eval);
            let x = tensor(x0.clone(), [2, 5, 9, 8]).require_grad();
            let y = if fused {
                bn.forward_after_conv(&conv, x.clone())
            } else {
                bn.forward(memsave::nn::conv2d(&conv, x.clone()))
            };
            conv_bn_outputs(&y, &x, &bn, Some(&conv))
        };
        assert_eq!(
            run(true),
            run(false),
            "k{k} s{stride} bias {bias} eval {eval}"
        );
    }
}

/// BN-ReLU and the max pooling after it as one op that keeps only the BN's input (the ReLU's
/// output and the maxima recomputed in backward): the same bits as the two steps.
#[test]
fn bn_relu_max_pool_keeping_the_input_equals_the_two_steps() {
    use burn::nn::pool::MaxPool2dConfig;
    use burn::nn::PaddingConfig2d;
    let pool = MaxPool2dConfig::new([3, 3])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init();
    for eval in [false, true] {
        let x0 = draws(2 * 6 * 11 * 10, 97, 1.5, 0.2);
        let run = |fused: bool| {
            let bn = bn_with_params(6, eval);
            let x = tensor(x0.clone(), [2, 6, 11, 10]).require_grad();
            let y = if fused {
                bn.forward_relu_max_pool(x.clone(), &pool)
            } else {
                memsave::nn::max_pool2d(&pool, bn.forward_relu(x.clone()))
            };
            conv_bn_outputs(&y, &x, &bn, None)
        };
        assert_eq!(run(true), run(false), "eval {eval}");
    }
}

/// memsave's linear op against Burn's `Linear::forward`, and the in-place accumulation of the
/// conv and linear weight gradients: a backward seeded with the sums of an earlier one gives
/// the sums of the two.
#[test]
fn linear_matches_burns_and_seeded_gradients_add_in_place() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::{Linear, LinearConfig};
    use memsave::train::grads;
    let device = Default::default();
    let fc: Linear<AB> = LinearConfig::new(12, 7).init(&device);
    let x = tensor(draws(5 * 12, 101, 1.0, 0.0), [5, 12]).require_grad();
    let run = |ours: bool| {
        let y = if ours {
            memsave::nn::linear(&fc, x.clone())
        } else {
            fc.forward(x.clone())
        };
        let grads = (y.clone() * y.clone().detach().sin()).sum().backward();
        vec![
            values(y.inner()),
            values(x.grad(&grads).unwrap()),
            values(fc.weight.grad(&grads).unwrap()),
            values(fc.bias.as_ref().unwrap().grad(&grads).unwrap()),
        ]
    };
    let (ours, burns) = (run(true), run(false));
    for (what, (a, b)) in ["y", "dx", "dw", "db"].iter().zip(ours.iter().zip(&burns)) {
        let d = max_relative_difference(a, b);
        assert!(d <= 1e-6, "linear {what}: {d}");
    }

    #[derive(burn::module::Module, Debug)]
    struct Net<B: Backend> {
        conv: burn::nn::conv::Conv2d<B>,
        fc: Linear<B>,
    }
    let net = Net::<AB> {
        conv: Conv2dConfig::new([3, 4], [3, 3]).init(&device),
        fc: LinearConfig::new(4 * 4 * 4, 5).init(&device),
    };
    let loss = |seed: u64| {
        let images = tensor(draws(2 * 3 * 6 * 6, seed, 1.0, 0.0), [2, 3, 6, 6]);
        let features = memsave::nn::conv2d(&net.conv, images).flatten::<2>(1, 3);
        memsave::nn::linear(&net.fc, features)
            .powf_scalar(2.0)
            .sum()
    };
    let first = grads::backward(loss(102), &net, None).unwrap();
    let second = grads::backward(loss(103), &net, None).unwrap();
    let seeded = grads::backward(
        loss(103),
        &net,
        Some(grads::backward(loss(102), &net, None).unwrap()),
    )
    .unwrap();
    let pick = |g: &burn::optim::GradientsParams| {
        vec![
            values(g.get::<Flex, 4>(net.conv.weight.id).unwrap()),
            values(g.get::<Flex, 2>(net.fc.weight.id).unwrap()),
            values(g.get::<Flex, 1>(net.fc.bias.as_ref().unwrap().id).unwrap()),
        ]
    };
    let (a, b, s) = (pick(&first), pick(&second), pick(&seeded));
    for (i, name) in ["conv weight", "fc weight", "fc bias"].iter().enumerate() {
        let sum: Vec<f32> = a[i].iter().zip(&b[i]).map(|(p, q)| p + q).collect();
        let d = max_relative_difference(&s[i], &sum);
        assert!(d <= 1e-6, "{name}: seeded {d}");
    }
}
