//! memsave's lean ops are found by trait, not by one backend type: every autodiff checkpoint
//! strategy of Burn gets them, and a ResNet step keeps the same bytes under Burn's
//! `BalancedCheckpointing` as under the default. One test: the counting allocator's counters
//! are process-wide.

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Distribution;
use memsave::memory;
use memsave_models::resnet::{ResNet, ResNetConfig};

#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    backbone: ResNet<B>,
    fc: Linear<B>,
}

/// Bytes above the start of a seeded ResNet-18 step (width 16, batch 2, 128 x 128): kept for backward at
/// the end of the forward, and the step's peak. The second of two steps (weights made).
fn step<B: AutodiffBackend + memsave::Backend>(with_cp: bool) -> (usize, usize) {
    let device = Default::default();
    B::seed(&device, 7);
    let model = Classifier {
        backbone: ResNetConfig {
            depth: 18,
            base_channels: 16,
            with_cp: if with_cp {
                memsave::planner::WithCp::On
            } else {
                memsave::planner::WithCp::Off
            },
            ..ResNetConfig::default()
        }
        .init::<B>(&device)
        .expect("a ResNet depth"),
        fc: LinearConfig::new(128, 10).init(&device),
    };
    let images = Tensor::<B, 4>::random([2, 3, 128, 128], Distribution::Normal(0.0, 1.0), &device);
    let labels = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![1i64, 3], [2]), &device);
    let criterion = CrossEntropyLossConfig::new().init(&device);
    let mut measured = (0, 0);
    for _ in 0..2 {
        let baseline = memory::reset_peak();
        let last = model
            .backbone
            .forward(images.clone())
            .pop()
            .expect("four maps");
        let logits = model.fc.forward(last.mean_dim(3).mean_dim(2).flatten(1, 3));
        let loss = criterion.forward(logits, labels.clone());
        let kept = memory::current_bytes() - baseline;
        let grads = loss.backward();
        memsave::checkpoint::join_helpers().unwrap();
        let peak = memory::peak_bytes() - baseline;
        drop(grads);
        measured = (kept, peak);
    }
    measured
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[test]
fn every_checkpoint_strategy_gets_the_lean_ops_and_keeps_the_same_bytes() {
    let _turn = crate::TURN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    type Plain = Autodiff<Flex, NoCheckpointing>;
    type Balanced = Autodiff<Flex, BalancedCheckpointing>;
    assert!(memsave::nn::is_lean::<Plain>());
    assert!(memsave::nn::is_lean::<Balanced>());
    assert!(memsave::nn::is_lean::<Flex>(), "the norms' untracked loops");
    assert!(
        !memsave::nn::is_lean::<Autodiff<Plain>>(),
        "an autodiff over an autodiff backend is not registered"
    );
    assert!(memsave::nn::lean_backends()
        .iter()
        .any(|name| name.contains("Flex")));

    for with_cp in [false, true] {
        let (plain_kept, plain_peak) = step::<Plain>(with_cp);
        let (balanced_kept, balanced_peak) = step::<Balanced>(with_cp);
        eprintln!(
            "with_cp={with_cp}: kept {:.2} MiB plain, {:.2} MiB balanced; peak {:.2} / {:.2} MiB",
            mib(plain_kept),
            mib(balanced_kept),
            mib(plain_peak),
            mib(balanced_peak)
        );
        // Burn's balanced strategy decides per op what to keep; memsave's ops (nearly all of a
        // ResNet) keep what they keep under either, so the bytes agree within 2%.
        let close = |a: usize, b: usize| (a as f64 / b as f64 - 1.0).abs() < 0.02;
        assert!(
            close(balanced_kept, plain_kept),
            "kept: balanced {balanced_kept} vs plain {plain_kept}"
        );
        assert!(
            close(balanced_peak, plain_peak),
            "peak: balanced {balanced_peak} vs plain {plain_peak}"
        );
    }
}
