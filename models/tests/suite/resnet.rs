//! The ResNet backbone: shapes, config errors, and gradients with and without checkpointing.

use std::collections::HashMap;

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::Distribution;
use memsave::checkpoint::{join_helpers, recomputations, set_with_cp};
use memsave_models::resnet::ResNetConfig;

type AB = Autodiff<Flex>;

struct Materialise;
impl<B: Backend> ModuleMapper<B> for Materialise {}

#[test]
fn feature_maps_have_the_strides_and_widths_of_the_stages() {
    let device = Default::default();
    for (depth, widths) in [(18, [64, 128, 256, 512]), (50, [256, 512, 1024, 2048])] {
        let model = ResNetConfig::new(depth).init::<Flex>(&device).unwrap();
        let images = Tensor::<Flex, 4>::zeros([1, 3, 64, 96], &device);
        let features = model.forward(images);
        let dims: Vec<[usize; 4]> = features.iter().map(|f| f.dims()).collect();
        assert_eq!(
            dims,
            vec![
                [1, widths[0], 16, 24],
                [1, widths[1], 8, 12],
                [1, widths[2], 4, 6],
                [1, widths[3], 2, 3]
            ],
            "ResNet-{depth}"
        );
    }
}

#[test]
fn block_counts_follow_the_depth() {
    let device = Default::default();
    for (depth, count) in [(18, 8), (34, 16), (50, 16), (101, 33)] {
        let model = ResNetConfig::new(depth).init::<Flex>(&device).unwrap();
        assert_eq!(model.blocks().count(), count, "ResNet-{depth}");
    }
}

#[test]
fn a_wrong_depth_is_an_error_naming_the_field() {
    let error = ResNetConfig::new(42)
        .init::<Flex>(&Default::default())
        .unwrap_err();
    let message = error.to_string();
    // The library names its own field; the config layer puts it under `model.backbone`.
    assert!(message.contains("`depth`"), "{message}");
    assert!(message.contains("42"), "{message}");
}

#[test]
fn with_cp_switches_every_block_and_keeps_the_gradients() {
    let device = Default::default();
    let plain = ResNetConfig::new(18)
        .init::<AB>(&device)
        .unwrap()
        .map(&mut Materialise);
    let checkpointed = set_with_cp(plain.clone(), true);
    assert!(checkpointed.blocks().all(|block| block.with_cp()));
    assert!(plain.blocks().all(|block| !block.with_cp()));
    let images = Tensor::<AB, 4>::random([2, 3, 32, 32], Distribution::Normal(0.0, 1.0), &device);
    let loss = |model: &memsave_models::resnet::ResNet<AB>| {
        model
            .forward(images.clone())
            .into_iter()
            .map(|f| f.powf_scalar(2.0).mean())
            .reduce(|a, b| a + b)
            .unwrap()
    };
    let g_plain = loss(&plain).backward();
    let g_cp = loss(&checkpointed).backward();
    assert_eq!(recomputations(), 8, "the 8 basic blocks were recomputed");
    join_helpers().unwrap();

    let (a, b) = (grads(&checkpointed, &g_cp), grads(&plain, &g_plain));
    assert_eq!(a.len(), b.len());
    assert!(!b.is_empty());
    for (id, reference) in &b {
        let got = &a[id];
        let scale = reference
            .iter()
            .fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(reference)
            .fold(0.0_f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff / scale <= 1e-6, "parameter {id}: {}", diff / scale);
    }
}

fn grads(
    model: &memsave_models::resnet::ResNet<AB>,
    grads: &burn::backend::autodiff::grads::Gradients,
) -> HashMap<ParamId, Vec<f32>> {
    struct Collect<'a>(
        &'a burn::backend::autodiff::grads::Gradients,
        HashMap<ParamId, Vec<f32>>,
    );
    impl ModuleVisitor<AB> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(grad) = param.val().grad(self.0) {
                self.1
                    .insert(param.id, grad.into_data().to_vec::<f32>().unwrap());
            }
        }
    }
    let mut collect = Collect(grads, HashMap::new());
    model.visit(&mut collect);
    collect.1
}

fn narrow(depth: usize) -> ResNetConfig {
    ResNetConfig {
        depth,
        base_channels: 16,
        ..ResNetConfig::default()
    }
}

fn feature_loss(
    model: &memsave_models::resnet::ResNet<AB>,
    images: Tensor<AB, 4>,
) -> Tensor<AB, 1> {
    model
        .forward(images)
        .into_iter()
        .map(|f| f.powf_scalar(2.0).mean())
        .reduce(|a, b| a + b)
        .unwrap()
}

/// (parameters, parameters that require a gradient).
fn count_params(model: &memsave_models::resnet::ResNet<AB>) -> (usize, usize) {
    struct Count(usize, usize);
    impl ModuleVisitor<AB> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.0 += 1;
            self.1 += param.val().is_require_grad() as usize;
        }
    }
    let mut count = Count(0, 0);
    model.visit(&mut count);
    (count.0, count.1)
}

#[test]
fn frozen_stages_take_no_gradient_and_no_optimizer_state_with_or_without_checkpointing() {
    use burn::optim::{momentum::MomentumConfig, GradientsParams, Optimizer, SgdConfig};
    let device = Default::default();
    let images = Tensor::<AB, 4>::random([2, 3, 32, 32], Distribution::Normal(0.0, 1.0), &device);
    // ResNet-18: the stem has 3 parameter tensors (conv, BN scale and shift), a basic block 6,
    // the downsampling of stages 2-4 3 each.
    for (frozen, expected_frozen) in [(-1, 0), (0, 3), (1, 3 + 12), (4, 3 + 4 * 12 + 3 * 3)] {
        let config = ResNetConfig {
            frozen_stages: frozen,
            ..narrow(18)
        };
        let plain = config.init::<AB>(&device).unwrap().map(&mut Materialise);
        // (Running statistics are visited too, and never require a gradient.)
        let all = count_params(&narrow(18).init::<AB>(&device).unwrap()).1;
        let trainable = count_params(&plain).1;
        assert_eq!(all - trainable, expected_frozen, "frozen_stages = {frozen}");
        if trainable == 0 {
            continue;
        }
        let checkpointed = set_with_cp(plain.clone(), true);
        let g_plain = feature_loss(&plain, images.clone()).backward();
        let before = recomputations();
        let g_cp = feature_loss(&checkpointed, images.clone()).backward();
        join_helpers().unwrap();
        // MMCV's guard: a block whose input does not require grad runs plainly. With the stem
        // frozen that is every frozen block and the first block after them.
        let plain_blocks = match frozen {
            -1 => 0,
            0 => 1,
            k => 2 * k as u64 + 1,
        };
        assert_eq!(
            recomputations() - before,
            8 - plain_blocks.min(8),
            "frozen_stages = {frozen}: blocks recomputed"
        );
        let (a, b) = (grads(&checkpointed, &g_cp), grads(&plain, &g_plain));
        assert_eq!(b.len(), trainable, "frozen_stages = {frozen}: gradients");
        assert_eq!(
            a.len(),
            trainable,
            "frozen_stages = {frozen}: checkpointed gradients"
        );
        for (id, reference) in &b {
            assert_eq!(
                &a[id], reference,
                "frozen_stages = {frozen}: parameter {id}"
            );
        }
        let mut optimizer = SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new()))
            .init::<AB, memsave_models::resnet::ResNet<AB>>();
        let model = optimizer.step(
            0.1,
            plain,
            GradientsParams::from_grads(g_plain, &checkpointed),
        );
        assert_eq!(
            optimizer.to_record().len(),
            trainable,
            "frozen_stages = {frozen}: momentum buffers"
        );
        assert_eq!(
            count_params(&model).1,
            trainable,
            "still frozen after a step"
        );
    }
}

#[test]
fn norm_eval_normalises_with_the_running_statistics_and_keeps_them() {
    let device = Default::default();
    let images = Tensor::<AB, 4>::random([2, 3, 32, 32], Distribution::Normal(0.5, 2.0), &device);
    let output = |model: &memsave_models::resnet::ResNet<AB>| -> Vec<f32> {
        model
            .forward(images.clone())
            .pop()
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap()
    };
    for norm_eval in [false, true] {
        let model = ResNetConfig {
            norm_eval,
            ..narrow(18)
        }
        .init::<AB>(&device)
        .unwrap();
        let first = output(&model);
        let second = output(&model);
        let inference: Vec<f32> = model
            .valid()
            .forward(images.clone().inner())
            .pop()
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap();
        let differs = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max)
                > 1e-3
        };
        assert_eq!(
            differs(&first, &inference),
            !norm_eval,
            "norm_eval = {norm_eval}: a training forward normalises with the running statistics"
        );
        if norm_eval {
            assert_eq!(first, second, "the running statistics did not move");
        }
    }
}

#[test]
fn out_indices_select_the_feature_maps() {
    let device = Default::default();
    let model = ResNetConfig {
        out_indices: vec![1, 3],
        ..narrow(18)
    }
    .init::<Flex>(&device)
    .unwrap();
    let dims: Vec<[usize; 4]> = model
        .forward(Tensor::zeros([1, 3, 64, 64], &device))
        .iter()
        .map(|f| f.dims())
        .collect();
    assert_eq!(dims, vec![[1, 32, 8, 8], [1, 128, 2, 2]]);
    for bad in [vec![], vec![4], vec![2, 1]] {
        let error = ResNetConfig {
            out_indices: bad.clone(),
            ..narrow(18)
        }
        .init::<Flex>(&device)
        .unwrap_err()
        .to_string();
        assert!(error.contains("`out_indices`"), "{bad:?}: {error}");
    }
}

#[test]
fn zero_init_residual_makes_every_block_without_downsampling_the_identity() {
    let device = Default::default();
    for depth in [18, 50] {
        let model = ResNetConfig {
            zero_init_residual: true,
            ..narrow(depth)
        }
        .init::<Flex>(&device)
        .unwrap();
        let width = if depth == 18 { 16 } else { 64 };
        // Block 1 of stage 1 keeps its input's shape; its input is a ReLU's output.
        let block = model.blocks().nth(1).unwrap();
        let input =
            Tensor::<Flex, 4>::random([1, width, 8, 8], Distribution::Normal(0.0, 1.0), &device)
                .clamp_min(0.0);
        let output = block.forward(input.clone());
        output
            .into_data()
            .assert_approx_eq::<f32>(&input.into_data(), Default::default());
    }
}

#[test]
fn caffe_style_moves_the_stride_to_the_first_convolution() {
    use memsave_models::resnet::{InitCfg, Style};
    let device = Default::default();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/resnet50_w8.safetensors");
    let config = |style| ResNetConfig {
        style,
        base_channels: 8,
        init_cfg: Some(InitCfg::Pretrained {
            checkpoint: fixture.clone(),
        }),
        ..ResNetConfig::default()
    };
    let images = Tensor::<Flex, 4>::random([1, 3, 64, 64], Distribution::Normal(0.0, 1.0), &device);
    let pytorch = config(Style::Pytorch)
        .init::<Flex>(&device)
        .unwrap()
        .forward(images.clone());
    let caffe = config(Style::Caffe)
        .init::<Flex>(&device)
        .unwrap()
        .forward(images);
    // The same weights, the same shapes; only C2 (no stride in stage 1) agrees.
    for (stage, (a, b)) in pytorch.into_iter().zip(caffe).enumerate() {
        assert_eq!(a.dims(), b.dims());
        let diff: f32 = (a - b).abs().max().into_scalar();
        assert_eq!(diff > 1e-4, stage > 0, "C{}: difference {diff}", stage + 2);
    }
    assert!(
        ResNetConfig {
            style: Style::Caffe,
            ..narrow(18)
        }
        .init::<Flex>(&device)
        .is_ok(),
        "basic blocks have no 1x1 convolution: the style changes nothing"
    );
}
