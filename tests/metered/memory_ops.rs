//! What the lean operations, the in-graph accumulation and the detector's checkpointed neck and
//! head keep, measured by the counting allocator. The counters are process-wide: the tests take
//! turns.

use burn::backend::{Autodiff, Flex};
use burn::nn::conv::Conv2dConfig;
use burn::nn::{BatchNormConfig as BurnBatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::Distribution;
use memsave::memory;
use memsave::nn::{conv2d, BatchNormConfig};
use memsave::train::grads;

type AB = Autodiff<Flex>;

/// Parallel tests would move each other's counters.
use crate::TURN as ONE_AT_A_TIME;

#[test]
fn lean_layers_keep_two_activations_per_conv_bn_relu_and_accumulation_keeps_one_gradient_set() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let device = Default::default();
    let (n, c, s) = (2, 16, 32);
    let activation = (n * c * s * s * 4) as f64;
    let conv = || {
        Conv2dConfig::new([c, c], [3, 3])
            .with_padding(PaddingConfig2d::Same)
            .with_bias(false)
            .init::<AB>(&device)
    };
    let (conv1, conv2) = (conv(), conv());
    let bn = BatchNormConfig::new(c).init::<AB>(&device);
    let burn_bn = BurnBatchNormConfig::new(c).init::<AB>(&device);
    let x = Tensor::<AB, 4>::random([n, c, s, s], Distribution::Normal(0.0, 1.0), &device)
        .require_grad();
    // Lazy weights and one-time caches first.
    let _ = conv2d(&conv2, bn.forward_relu(conv2d(&conv1, x.clone())))
        .sum()
        .backward();
    let _ = conv2
        .forward(burn::tensor::activation::relu(
            burn_bn.forward(conv1.forward(x.clone())),
        ))
        .sum()
        .backward();

    // Kept between forward and backward, the chain's output excluded: memsave's keeps the conv
    // output (for BN) and the BN-ReLU output (for the second conv), or fused only the first;
    // Burn's composition more.
    let kept = |layers: u8| {
        let before = memory::current_bytes();
        let y = if layers == 2 {
            bn.forward_relu_conv(conv2d(&conv1, x.clone()), &conv2)
        } else if layers == 1 {
            conv2d(&conv2, bn.forward_relu(conv2d(&conv1, x.clone())))
        } else {
            conv2.forward(burn::tensor::activation::relu(
                burn_bn.forward(conv1.forward(x.clone())),
            ))
        };
        let kept = (memory::current_bytes() - before) as f64 / activation - 1.0;
        let _ = y.sum().backward();
        kept
    };
    let (fused, ours, burns) = (kept(2), kept(1), kept(0));
    eprintln!(
        "conv-BN-ReLU-conv keeps {fused:.2} activations fused, {ours:.2} unfused (Burn's \
         composition {burns:.2})"
    );
    assert!(fused <= 1.25, "{fused}");
    assert!(ours <= 2.25, "{ours}");
    assert!(burns >= ours + 1.5, "Burn's: {burns}, memsave's: {ours}");

    // A ResNet's downsample (conv, then BN) keeps only its input, which the block's first
    // conv keeps anyway; the two steps keep the conv's output too. A stem's BN-ReLU-max-pool
    // keeps only the BN's input; the steps keep the pooling's indices too (8 bytes each).
    let pool = burn::nn::pool::MaxPool2dConfig::new([3, 3])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init();
    let kept_by = |fused: bool, downsample: bool| {
        let before = memory::current_bytes();
        let y = match (downsample, fused) {
            (true, true) => bn.forward_after_conv(&conv1, x.clone()),
            (true, false) => bn.forward(conv2d(&conv1, x.clone())),
            (false, true) => bn.forward_relu_max_pool(x.clone(), &pool),
            (false, false) => memsave::nn::max_pool2d(&pool, bn.forward_relu(x.clone())),
        };
        let output = y.shape().num_elements() as f64 * 4.0 / activation;
        let kept = (memory::current_bytes() - before) as f64 / activation - output;
        let _ = y.sum().backward();
        kept
    };
    // Lazy weights and one-time caches first.
    let _ = kept_by(true, true) + kept_by(false, true) + kept_by(true, false);
    let (down_fused, down_steps) = (kept_by(true, true), kept_by(false, true));
    let (stem_fused, stem_steps) = (kept_by(true, false), kept_by(false, false));
    eprintln!(
        "conv-BN keeps {down_fused:.2} activations fused, {down_steps:.2} as two steps; \
         BN-ReLU-max-pool {stem_fused:.2} fused, {stem_steps:.2} as two steps"
    );
    assert!(down_fused <= 0.1, "{down_fused}");
    assert!(down_steps >= 0.9, "{down_steps}");
    assert!(stem_fused <= 0.1, "{stem_fused}");
    assert!(
        stem_steps >= stem_fused + 0.4,
        "{stem_steps} vs {stem_fused}"
    );

    // A residual block's add and its last ReLU take their inputs' buffers: where nothing else
    // holds an input, the result is written into it, and the step's peak above its start is
    // the output alone, not the output beside both inputs (commit fc9a2c7's lean add cloned its
    // inputs, and ResNet-50's checkpointed peak rose from 186.8 to 193.5 MiB).
    let residual = |relu: bool| {
        let a = x.clone() * 2.0;
        let b = x.clone() * 3.0;
        let base = memory::reset_peak();
        let y = memsave::nn::add(a, b);
        let y = if relu { memsave::nn::relu(y) } else { y };
        let peak = (memory::peak_bytes() - base) as f64 / activation;
        let _ = y.sum().backward();
        peak
    };
    let _ = residual(true);
    let (add, add_relu) = (residual(false), residual(true));
    eprintln!("the residual add's peak above its inputs: {add:.2} activations, with its ReLU {add_relu:.2}");
    assert!(add <= 0.1, "{add}");
    assert!(add_relu <= 0.1, "{add_relu}");

    // Accumulation: the sums of earlier micro-batches seed the backward pass, so the step's peak
    // above its start is that of a backward without sums (no second set of gradients).
    let model: Linear<AB> = LinearConfig::new(512, 512).init(&device);
    let input = Tensor::<AB, 2>::random([4, 512], Distribution::Normal(0.0, 1.0), &device);
    let step = |sums| grads::backward(model.forward(input.clone()).sum(), &model, sums).unwrap();
    let sums = step(None);
    let base = memory::reset_peak();
    drop(step(None));
    let plain = memory::peak_bytes() - base;
    let base = memory::reset_peak();
    let summed = step(Some(sums));
    let seeded = memory::peak_bytes() - base;
    let weights = 512 * 512 * 4;
    eprintln!("backward peak above its start: {plain} B alone, {seeded} B onto the sums");
    assert!(seeded <= plain + weights / 8, "{seeded} vs {plain}");
    drop(summed);
}

/// With the backbone checkpointed, what the detector keeps after its forward is mostly the
/// neck's and the head's activations; their own `with_cp` keys recompute them, and the head keeps
/// each level's input alone.
#[test]
fn the_detectors_neck_and_head_checkpointed_keep_less_after_the_forward() {
    use memsave::models::detection::fpn::FpnConfig;
    use memsave::models::detection::retinanet::RetinaNetConfig;
    use memsave::models::resnet::ResNetConfig;
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let device = Default::default();
    let model = |neck: bool, head: bool| {
        let mut config = RetinaNetConfig::r50_fpn(4);
        config.backbone = ResNetConfig {
            depth: 18,
            base_channels: 8,
            frozen_stages: -1,
            ..ResNetConfig::default()
        }
        .with_with_cp(true);
        config.neck = FpnConfig {
            in_channels: vec![8, 16, 32, 64],
            out_channels: 32,
            with_cp: neck,
            ..FpnConfig::default()
        };
        config.bbox_head.in_channels = 32;
        config.bbox_head.feat_channels = 32;
        config.bbox_head.with_cp = head;
        config.init::<AB>(&device).unwrap()
    };
    let images = Tensor::<AB, 4>::random([2, 3, 128, 128], Distribution::Default, &device);
    // Kept after the forward, the outputs included (the same in both).
    let kept = |neck: bool, head: bool| {
        let model = model(neck, head);
        // Lazy weights first.
        drop(model.forward(images.clone()));
        let before = memory::current_bytes();
        let (outs, _) = model.forward(images.clone());
        let kept = memory::current_bytes() - before;
        let loss = outs
            .into_iter()
            .map(|(cls, reg)| cls.sum() + reg.sum())
            .reduce(|a, b| a + b)
            .unwrap();
        drop(loss.backward());
        memsave::checkpoint::join_helpers().unwrap();
        kept as f64 / (1 << 20) as f64
    };
    let (backbone, neck, both) = (kept(false, false), kept(true, false), kept(true, true));
    eprintln!(
        "RetinaNet R18-FPN (8-wide backbone, 32-channel FPN and head), 2 x 128 x 128, kept after \
         the forward with the backbone checkpointed: {backbone:.2} MiB; the neck too \
         {neck:.2} MiB; the neck and the head {both:.2} MiB ({:.2}x)",
        both / backbone
    );
    assert!(neck < backbone, "{neck} vs {backbone}");
    // What stays: the stem's activations (nothing checkpoints it), the images, the outputs and
    // each segment's input.
    assert!(both < 0.8 * backbone, "{both} vs {backbone}");
}
