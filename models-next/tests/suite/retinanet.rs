//! RetinaNet on Burn 0.22 (`memsave_models_next::detection`), as on Burn 0.21: the
//! suppression and the detections' way back to the original image; the detector's levels and
//! initial scores, its targets, its segments (every part checkpointed: the plain gradients,
//! the switch read by the bytes its forward keeps), half precision against fp32, and the
//! pinned list of segments.

use crate::common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use common::watchdog;
use memsave_models_next::detection::fpn::FpnConfig;
use memsave_models_next::detection::postprocess::{batched_nms, detections, TestCfg};
use memsave_models_next::detection::retinanet::RetinaNetConfig;
use memsave_models_next::detection::{DetectionBatch, ImageMeta};
use memsave_models_next::resnet::ResNetConfig;
use memsave_next::checkpoint::{segment_paths, set_with_cp, set_with_cp_paths};
use memsave_next::fp16::{wrap_fp16_model, Precision};
use memsave_next::memory;
use memsave_next::planner::WithCp;
use memsave_next::train::TrainModel;

fn param_grads<M: Module>(model: &M, grads: &burn::tensor::Gradients) -> Vec<Vec<f32>> {
    struct Collect<'a>(&'a burn::tensor::Gradients, Vec<Vec<f32>>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = param.val().grad(self.0) {
                self.1
                    .push(g.into_data().convert::<f32>().try_to_vec().unwrap());
            }
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

#[test]
fn nms_keeps_the_best_of_overlapping_boxes_per_class() {
    let _turn = common::one_at_a_time();
    let boxes = [
        [0.0, 0.0, 10.0, 10.0],
        [1.0, 1.0, 11.0, 11.0], // IoU 81/119 with the first: suppressed
        [20.0, 20.0, 30.0, 30.0],
        [0.0, 0.0, 10.0, 10.0], // another class: kept
        [0.0, 0.0, 10.0, 14.0], // IoU 100/140 = 0.71 with the first: suppressed
        [0.0, 0.0, 10.0, 25.0], // IoU 0.4: kept
    ];
    let scores = [0.9, 0.8, 0.7, 0.6, 0.95, 0.5];
    let labels = [0, 0, 0, 1, 2, 0];
    // Box 4 is class 2, alone in its class: kept first (best score).
    assert_eq!(
        batched_nms(&boxes, &scores, &labels, 0.5, 0),
        vec![4, 0, 2, 3, 5]
    );
    let labels = [0, 0, 0, 1, 0, 0];
    // Now box 4 (0.71, 0.6 and 0.56 over boxes 0, 1 and 5) suppresses them all.
    assert_eq!(batched_nms(&boxes, &scores, &labels, 0.5, 0), vec![4, 2, 3]);
    assert_eq!(batched_nms(&boxes, &scores, &labels, 0.5, 2), vec![4, 2]);
    assert!(batched_nms(&[], &[], &[], 0.5, 0).is_empty());
}

#[test]
fn detections_go_back_to_the_original_image_and_keep_the_best_per_image() {
    let _turn = common::one_at_a_time();
    let cfg = TestCfg {
        max_per_img: 2,
        ..TestCfg::default()
    };
    let meta = ImageMeta {
        id: "x".into(),
        ori_shape: [100, 200],
        img_shape: [50, 100],
        pad_shape: [64, 128],
        scale_factor: [0.5, 0.5],
        flip: true,
    };
    let candidates = vec![
        ([10.0, 10.0, 30.0, 20.0], vec![0.9, 0.04]),
        ([60.0, 10.0, 80.0, 20.0], vec![0.02, 0.3]),
        ([60.0, 30.0, 80.0, 40.0], vec![0.2, 0.01]),
    ];
    let dets = detections(&cfg, candidates, &meta);
    assert_eq!(dets.len(), 2, "{dets:?}");
    // Un-flipped in the 100-wide resized image (x -> 100 - x), then doubled.
    assert_eq!(dets[0].bbox, [140.0, 20.0, 180.0, 40.0]);
    assert_eq!((dets[0].label, dets[0].score), (0, 0.9));
    assert_eq!(dets[1].bbox, [40.0, 20.0, 80.0, 40.0]);
    assert_eq!(dets[1].label, 1);
}

/// A small RetinaNet: ResNet-18 of base width 8, FPN and head of 32 channels, 2 convs per branch.
pub fn small_config(num_classes: usize) -> RetinaNetConfig {
    let mut config = RetinaNetConfig::r50_fpn(num_classes);
    config.backbone = ResNetConfig {
        depth: 18,
        base_channels: 8,
        frozen_stages: 1,
        norm_eval: true,
        ..ResNetConfig::default()
    };
    config.neck = FpnConfig {
        in_channels: vec![8, 16, 32, 64],
        out_channels: 32,
        ..FpnConfig::default()
    };
    config.bbox_head.in_channels = 32;
    config.bbox_head.feat_channels = 32;
    config.bbox_head.stacked_convs = 2;
    config
}

fn batch(device: &Device) -> DetectionBatch {
    let meta = |id: &str, pad: [usize; 2]| ImageMeta {
        id: id.into(),
        ori_shape: pad,
        img_shape: pad,
        pad_shape: pad,
        scale_factor: [1.0, 1.0],
        flip: false,
    };
    let images = Tensor::<4>::random(
        [2, 3, 96, 128],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        device,
    );
    DetectionBatch {
        images,
        metas: vec![meta("a", [96, 128]), meta("b", [64, 96])],
        gt_bboxes: vec![
            vec![[10.0, 20.0, 50.0, 70.0], [60.0, 8.0, 120.0, 40.0]],
            vec![],
        ],
        gt_labels: vec![vec![3, 0], vec![]],
    }
}

#[test]
fn the_detector_has_five_levels_starting_at_the_prior() {
    let _turn = common::one_at_a_time();
    let device = Device::flex().autodiff();
    let model = small_config(4).init(&device).unwrap();
    let (outs, sizes) = model.forward(Tensor::zeros([1, 3, 96, 128], &device));
    assert_eq!(sizes, vec![[12, 16], [6, 8], [3, 4], [2, 2], [1, 1]]);
    for ((cls, reg), [h, w]) in outs.into_iter().zip(&sizes) {
        assert_eq!(cls.dims(), [1, h * w * 9, 4]);
        assert_eq!(reg.dims(), [1, h * w * 9, 4]);
        let p = burn::tensor::activation::sigmoid(cls);
        let (lo, hi): (f32, f32) = (p.clone().min().into_scalar(), p.max().into_scalar());
        assert!(
            lo > 0.008 && hi < 0.012,
            "scores start at the prior 0.01: {lo}..{hi}"
        );
    }
}

#[test]
fn targets_ignore_the_padding_and_average_over_positives() {
    let _turn = common::one_at_a_time();
    let device = Device::flex().autodiff();
    let model = small_config(4).init(&device).unwrap();
    let b = batch(&device);
    let sizes = [[12, 16], [6, 8], [3, 4], [2, 2], [1, 1]];
    let t = model.targets(&sizes, &b.metas, &b.gt_bboxes, &b.gt_labels, &device);
    assert!(
        t.num_pos[0] >= 2,
        "each object has an anchor: {:?}",
        t.num_pos
    );
    assert_eq!(t.num_pos[1], 0);
    assert_eq!(t.avg_factor, (t.num_pos[0] + 1) as f32);
    let labels: Vec<f32> = t
        .labels
        .clone()
        .sum_dim(1)
        .into_data()
        .try_to_vec()
        .unwrap();
    assert!(
        labels[3] >= 1.0 && labels[0] >= 1.0 && labels[1] == 0.0 && labels[2] == 0.0,
        "{labels:?}"
    );
    // Image b is 64 x 96 inside the 96 x 128 batch: P3 rows 8.. and columns 12.. are padding.
    let weights: Vec<f32> = t.label_weights.into_data().try_to_vec().unwrap();
    let a = weights.len() / 2;
    let p3 = |y: usize, x: usize| weights[a + (y * 16 + x) * 9];
    assert_eq!(
        (p3(0, 0), p3(7, 11), p3(8, 0), p3(0, 12)),
        (1.0, 1.0, 0.0, 0.0)
    );
}

/// Every part checkpointed, as the config's keys and `set_with_cp` switch it: the plain
/// gradients, bit for bit for the backbone; for the neck and the head within float rounding
/// (where a tensor is read across a segment's edge by three ops, Burn sums its gradients in
/// another order; the same bound as on Burn 0.21). The switch is read: each forward keeps fewer
/// bytes than the plain one.
#[test]
fn checkpointing_any_part_leaves_the_detectors_gradients_unchanged() {
    watchdog(300, || {
        let device = Device::flex().autodiff();
        device.seed(3);
        let plain = small_config(4).init(&device).unwrap();
        // Four times the area of `batch`'s images, so that the activations outweigh what a segment
        // keeps of its own.
        let mut b = batch(&device);
        b.images = Tensor::<4>::random(
            [2, 3, 192, 256],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        for meta in &mut b.metas {
            meta.img_shape = [meta.img_shape[0] * 2, meta.img_shape[1] * 2];
            meta.pad_shape = meta.img_shape;
            meta.ori_shape = meta.img_shape;
        }
        let meter = memory::meter_for(&device).unwrap();
        let run = |model: &memsave_models_next::detection::retinanet::RetinaNet| {
            let before = meter.live();
            let loss = model.loss(b.clone());
            let kept = meter.live().saturating_sub(before);
            let grads = memsave_next::checkpoint::backward(loss);
            (param_grads(model, &grads), kept)
        };
        // Once to initialise the lazily made parameters (the neck's and the head's), whose bytes
        // would count as kept; then the reference.
        let _ = run(&plain);
        let (reference, kept_plain) = run(&plain);
        assert!(reference.len() > 20);
        let paths = segment_paths(&plain);
        assert!(
            paths.contains(&"neck".to_string()) && paths.contains(&"bbox_head".to_string()),
            "{paths:?}"
        );
        let under = |prefix: &str| -> Vec<String> {
            paths
                .iter()
                .filter(|p| p.starts_with(prefix))
                .cloned()
                .collect()
        };
        let rounding = 1e-6;
        let cases = [
            ("the backbone", under("backbone."), 0.0),
            (
                "the neck and the head",
                vec!["neck".into(), "bbox_head".into()],
                rounding,
            ),
            ("the neck", vec!["neck".into()], rounding),
            ("the head", vec!["bbox_head".into()], rounding),
        ];
        let mut worst = Vec::new();
        let mut models: Vec<(&str, _, f32)> = cases
            .into_iter()
            .map(|(what, paths, bound)| {
                (
                    what,
                    set_with_cp_paths(plain.clone(), &paths).unwrap(),
                    bound,
                )
            })
            .collect();
        models.push((
            "everything (set_with_cp)",
            set_with_cp(plain.clone(), true),
            rounding,
        ));
        for (what, model, bound) in models {
            let (got, kept) = run(&model);
            assert!(
                kept < kept_plain,
                "{what}: {kept} bytes kept, plain {kept_plain}"
            );
            assert_eq!(reference.len(), got.len());
            let mut case_worst = 0.0f32;
            for (index, (x, y)) in reference.iter().zip(&got).enumerate() {
                let diff = x
                    .iter()
                    .zip(y)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0, f32::max);
                let scale = x.iter().map(|p| p.abs()).fold(f32::MIN_POSITIVE, f32::max);
                let relative = diff / scale;
                assert!(
                    relative <= bound,
                    "{what}: parameter {index}: max difference {diff:e} of {scale:e}"
                );
                case_worst = case_worst.max(relative);
            }
            worst.push(format!(
                "{what} {case_worst:.1e} ({kept} of {kept_plain} bytes kept)"
            ));
        }
        eprintln!(
            "RetinaNet checkpointed vs plain, worst relative gradient difference: {}",
            worst.join(", ")
        );
    });
}

#[test]
fn the_detector_in_half_precision_gives_the_fp32_loss_and_gradients() {
    watchdog(300, || {
        // The same weights in every run, whatever else draws from Flex's process-wide random
        // stream meanwhile (tests run in parallel): each parameter redrawn from a seeded generator,
        // constants (the classifier's prior bias, BatchNorm's ones) kept.
        struct Seeded(u64);
        impl burn::module::ModuleMapper for Seeded {
            fn map_float<const D: usize>(
                &mut self,
                param: burn::module::Param<Tensor<D>>,
            ) -> burn::module::Param<Tensor<D>> {
                let (id, tensor, mapper) = param.consume();
                let shape = tensor.shape();
                let values: Vec<f32> = tensor
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec()
                    .unwrap();
                let n = values.len() as f64;
                let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
                let varies = values.iter().any(|&v| (v as f64 - mean).abs() > 1e-6);
                // Weights: centred, spread 1 / sqrt(fan-in); vectors: their constant (to 1e-3) or
                // a small spread.
                let (mean, spread) = if D >= 2 {
                    (
                        0.0,
                        1.0 / ((shape.num_elements() / tensor.dims()[0]) as f64).sqrt(),
                    )
                } else if varies {
                    (0.0, 0.05)
                } else {
                    ((mean * 1000.0).round() / 1000.0, 0.0)
                };
                let fresh: Vec<f32> = (0..values.len())
                    .map(|_| {
                        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
                        let mut z = self.0;
                        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                        z ^= z >> 31;
                        let unit = (z >> 11) as f64 / (1u64 << 53) as f64;
                        (mean + spread * (2.0 * unit - 1.0)) as f32
                    })
                    .collect();
                let data = burn::tensor::TensorData::new(fresh, shape);
                let value = Tensor::<D>::from_data(data, &tensor.device());
                let value = if tensor.is_require_grad() {
                    value.require_grad()
                } else {
                    value
                };
                burn::module::Param::from_mapped_value(id, value, mapper)
            }
        }
        let device = Device::flex().autodiff();
        let fp32 = small_config(4).init(&device).unwrap().map(&mut Seeded(11));
        let mut b = batch(&device);
        // Seeded images too (a smooth pattern, normalised-image scale).
        let values: Vec<f32> = (0..2 * 3 * 96 * 128)
            .map(|i| ((i as f32 * 0.37).sin() + (i as f32 * 0.011).cos()) * 0.8)
            .collect();
        b.images = Tensor::from_data(
            burn::tensor::TensorData::new(values, [2, 3, 96, 128]),
            &device,
        );
        for precision in [Precision::F16, Precision::Bf16] {
            let half = wrap_fp16_model(fp32.clone(), precision);
            let (l32, l16) = (fp32.loss(b.clone()), half.loss(b.clone()));
            let (v32, v16): (f32, f32) = (l32.clone().into_scalar(), l16.clone().into_scalar());
            assert!(
                (v32 - v16).abs() <= 1e-2 * v32.abs(),
                "{precision:?}: loss {v16} vs {v32}"
            );
            let (g32, g16) = (l32.backward(), l16.backward());
            let (a, b) = (param_grads(&fp32, &g32), param_grads(&half, &g16));
            assert_eq!(a.len(), b.len());
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for (x, y) in a.iter().zip(&b) {
                for (p, q) in x.iter().zip(y) {
                    diff += ((p - q) as f64).powi(2);
                    norm += (*p as f64).powi(2);
                }
            }
            let relative = (diff / norm).sqrt();
            println!("{precision:?}: loss {v16} vs {v32}, gradients {relative:.2e}");
            assert!(relative <= 5e-2, "{precision:?}: gradients {relative:.2e}");
        }
    });
}

/// With the backbone's segments pinned by path, the neck's and head's own keys join the list,
/// and every path names a segment of the built detector.
#[test]
fn the_neck_and_head_keys_join_a_pinned_list_of_segments() {
    let _turn = common::one_at_a_time();
    let mut config = small_config(4);
    config.backbone.with_cp = WithCp::Paths(vec!["backbone.layer4.1".into()]);
    assert_eq!(config.with_cp(), config.backbone.with_cp);
    config.neck.with_cp = true;
    config.bbox_head.with_cp = true;
    let WithCp::Paths(paths) = config.with_cp() else {
        panic!("a list stays a list");
    };
    assert_eq!(paths, ["backbone.layer4.1", "neck", "bbox_head"]);
    let model = config.init(&Device::flex().autodiff()).unwrap();
    set_with_cp_paths(model, &paths).unwrap();
    config.backbone.with_cp = WithCp::Auto;
    let error = config.check().unwrap_err().to_string();
    assert!(error.contains("neck.with_cp"), "{error}");
}
