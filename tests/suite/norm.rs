//! memsave's BatchNorm and GroupNorm against hand computations (PyTorch semantics).

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use memsave::nn::{BatchNormConfig, GroupNormConfig};

type B = Flex;
type AB = Autodiff<Flex>;

fn close(actual: &[f32], expected: &[f32], tolerance: f32) {
    assert_eq!(actual.len(), expected.len());
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!((a - e).abs() <= tolerance, "element {i}: {a} vs {e}");
    }
}

/// Batch of 2, 2 channels, 1x2 spatial: channel 0 holds 1, 2, 3, 4; channel 1 holds 0, 0, 2, 6.
fn input<Bk: Backend>() -> Tensor<Bk, 4> {
    Tensor::from_floats(
        [[[[1.0, 2.0]], [[0.0, 0.0]]], [[[3.0, 4.0]], [[2.0, 6.0]]]],
        &Default::default(),
    )
}

#[test]
fn batch_norm_training_uses_batch_statistics_and_updates_running_ones_like_pytorch() {
    let bn = BatchNormConfig::new(2).init::<AB>(&Default::default());
    let out = bn.forward(input::<AB>());
    // Channel 0: mean 2.5, biased var 1.25; channel 1: mean 2, biased var 6.
    let eps = 1e-5_f32;
    let n0 = |v: f32| (v - 2.5) / (1.25 + eps).sqrt();
    let n1 = |v: f32| (v - 2.0) / (6.0 + eps).sqrt();
    let expected = [
        n0(1.0),
        n0(2.0),
        n1(0.0),
        n1(0.0),
        n0(3.0),
        n0(4.0),
        n1(2.0),
        n1(6.0),
    ];
    close(&out.into_data().to_vec::<f32>().unwrap(), &expected, 1e-5);

    // Running statistics: momentum 0.1; the variance is the unbiased one (n / (n - 1)).
    let mean = bn
        .running_mean
        .value_sync()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let var = bn
        .running_var
        .value_sync()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    close(&mean, &[0.25, 0.2], 1e-6);
    close(
        &var,
        &[0.9 + 0.1 * 1.25 * 4.0 / 3.0, 0.9 + 0.1 * 6.0 * 4.0 / 3.0],
        1e-6,
    );
}

#[test]
fn batch_norm_inference_uses_running_statistics() {
    let bn = BatchNormConfig::new(2).init::<B>(&Default::default());
    let out = bn.forward(input::<B>());
    // Fresh running statistics: mean 0, var 1, so the output is x / sqrt(1 + eps).
    let expected: Vec<f32> = [1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 2.0, 6.0]
        .iter()
        .map(|v| v / (1.0_f32 + 1e-5).sqrt())
        .collect();
    close(&out.into_data().to_vec::<f32>().unwrap(), &expected, 1e-6);
}

#[test]
fn group_norm_normalises_each_group_of_each_sample() {
    let gn = GroupNormConfig::new(1, 2).init::<B>(&Default::default());
    let out = gn.forward(input::<B>());
    // Sample 0: 1, 2, 0, 0 (mean 0.75, var 0.6875); sample 1: 3, 4, 2, 6 (mean 3.75, var 2.1875).
    let eps = 1e-5_f32;
    let s0 = |v: f32| (v - 0.75) / (0.6875 + eps).sqrt();
    let s1 = |v: f32| (v - 3.75) / (2.1875 + eps).sqrt();
    let expected = [
        s0(1.0),
        s0(2.0),
        s0(0.0),
        s0(0.0),
        s1(3.0),
        s1(4.0),
        s1(2.0),
        s1(6.0),
    ];
    close(&out.into_data().to_vec::<f32>().unwrap(), &expected, 1e-5);
}

/// A fresh BatchNorm in eval mode (`norm_eval`, frozen stages) normalises with its running
/// statistics as constants: its scale's gradient is `sum(dy * x / sqrt(1 + eps))`, and no
/// gradient reaches the statistics (they once shared an autodiff node with the parameters).
#[test]
fn batch_norm_in_eval_mode_treats_fresh_running_statistics_as_constants() {
    use burn::tensor::Distribution;
    let device = Default::default();
    let bn = memsave::nn::BatchNormConfig::new(3)
        .init::<AB>(&device)
        .with_eval(true);
    let x = Tensor::<AB, 4>::random([2, 3, 4, 4], Distribution::Normal(0.5, 2.0), &device);
    let w = Tensor::<AB, 4>::random([2, 3, 4, 4], Distribution::Normal(0.0, 1.0), &device);
    for relu in [false, true] {
        let y = if relu {
            bn.forward_relu(x.clone())
        } else {
            bn.forward(x.clone())
        };
        let grads = (y.clone() * w.clone()).sum().backward();
        let x_hat = x.clone().inner().div_scalar((1.0f64 + 1e-5).sqrt());
        let mut dy = w.clone().inner();
        if relu {
            dy = dy.mask_fill(y.inner().lower_equal_elem(0.0), 0.0);
        }
        let expected: Vec<f32> = (dy * x_hat)
            .sum_dim(0)
            .sum_dim(2)
            .sum_dim(3)
            .flatten::<1>(0, 3)
            .into_data()
            .to_vec()
            .unwrap();
        let got: Vec<f32> = bn
            .gamma
            .val()
            .grad(&grads)
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap();
        for (g, e) in got.iter().zip(&expected) {
            assert!(
                (g - e).abs() <= 1e-4 * e.abs().max(1.0),
                "relu {relu}: {got:?} vs {expected:?}"
            );
        }
        assert!(
            bn.running_mean.value().grad(&grads).is_none(),
            "relu {relu}"
        );
        assert!(bn.running_var.value().grad(&grads).is_none(), "relu {relu}");
    }
}
