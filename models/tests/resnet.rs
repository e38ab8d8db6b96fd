//! The ResNet backbone: shapes, config errors, and gradients with and without checkpointing.

use std::collections::HashMap;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
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
    assert!(message.contains("model.backbone.depth"), "{message}");
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
    join_helpers();

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
