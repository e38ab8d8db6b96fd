//! RetinaNet's pieces, each against values computed by hand, by MMDetection's formulas, or by
//! torchvision (focal loss); then the whole detector: shapes, initial scores, targets, and the
//! same gradients with and without checkpointing.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use memsave_models::detection::anchors::AnchorGeneratorConfig;
use memsave_models::detection::assigner::{Assignment, MaxIoUAssignerConfig};
use memsave_models::detection::boxes::{iou, iou_matrix};
use memsave_models::detection::coder::{decode, encode};
use memsave_models::detection::fpn::FpnConfig;
use memsave_models::detection::losses::sigmoid_focal_loss;
use memsave_models::detection::postprocess::{batched_nms, detections, TestCfg};
use memsave_models::detection::retinanet::RetinaNetConfig;
use memsave_models::detection::{DetectionBatch, ImageMeta};
use memsave_models::resnet::ResNetConfig;

type AB = Autodiff<Flex>;

fn close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

#[test]
fn anchors_of_a_level_follow_mmdetections_generator() {
    let g = AnchorGeneratorConfig::default();
    assert_eq!(g.num_base_anchors(), 9);
    let base = g.base_anchors(0);
    // Ratio 0.5 (h / w), scale 4: w = 8 * sqrt(2) * 4, h = 8 / sqrt(2) * 4, centred at 0.
    let (w, h) = (8.0 * 2f32.sqrt() * 4.0, 8.0 / 2f32.sqrt() * 4.0);
    let expected = [-w / 2.0, -h / 2.0, w / 2.0, h / 2.0];
    for k in 0..4 {
        assert!(close(base[0][k], expected[k], 1e-5), "{:?}", base[0]);
    }
    assert!(close(base[0][0], -22.6274, 1e-5));
    // Ratio-major: anchors 0..3 are ratio 0.5 at scales 4, 4 * 2^(1/3), 4 * 2^(2/3).
    let widths: Vec<f32> = base.iter().map(|a| a[2] - a[0]).collect();
    assert!(close(widths[1] / widths[0], 2f32.powf(1.0 / 3.0), 1e-5));
    assert!(
        close(widths[3], 4.0 * 8.0, 1e-5),
        "ratio 1, scale 4: 32 wide"
    );
    assert!(close(
        base[4][2] - base[4][0],
        4.0 * 8.0 * 2f32.powf(1.0 / 3.0),
        1e-5
    ));
    // P7 (stride 128): 512 wide squares at scale 4.
    let p7 = g.base_anchors(4);
    assert!(close(p7[3][2] - p7[3][0], 512.0, 1e-5));

    // Grid: location-major, each location the base anchors shifted by the stride.
    let grid = g.grid_anchors(1, [2, 3]);
    assert_eq!(grid.len(), 2 * 3 * 9);
    let base1 = g.base_anchors(1);
    let location = |y: usize, x: usize, a: usize| grid[(y * 3 + x) * 9 + a];
    assert_eq!(location(0, 0, 5), base1[5]);
    let shifted = location(1, 2, 7);
    assert_eq!(
        shifted,
        [
            base1[7][0] + 32.0,
            base1[7][1] + 16.0,
            base1[7][2] + 32.0,
            base1[7][3] + 16.0
        ]
    );

    // Valid flags: an image padded to 20 x 12 covers ceil(20/8) = 3 rows, ceil(12/8) = 2
    // columns of a 3 x 3 map at stride 8.
    let flags = g.valid_flags(0, [3, 3], [20, 12]);
    for y in 0..3 {
        for x in 0..3 {
            for a in 0..9 {
                assert_eq!(flags[(y * 3 + x) * 9 + a], x < 2, "({y}, {x})");
            }
        }
    }
}

#[test]
fn deltas_encode_and_decode_as_mmdetections_coder() {
    let anchor = [0.0, 0.0, 10.0, 10.0];
    let target = [2.0, 2.0, 12.0, 22.0];
    let d = encode(&anchor, &target);
    let expected = [0.2, 0.7, 0.0, 2f32.ln()];
    for k in 0..4 {
        assert!(close(d[k], expected[k], 1e-6), "{d:?}");
    }
    let back = decode(&anchor, &d, None);
    for k in 0..4 {
        assert!(close(back[k], target[k], 1e-5), "{back:?}");
    }
    // Round trip on assorted boxes.
    for (a, t) in [
        ([3.0, 4.0, 50.0, 20.0], [10.0, 1.0, 30.0, 80.0]),
        ([-20.0, -10.0, 20.0, 10.0], [0.5, 0.25, 1.5, 9.0]),
    ] {
        let b = decode(&a, &encode(&a, &t), None);
        for k in 0..4 {
            assert!(close(b[k], t[k], 1e-4), "{b:?} vs {t:?}");
        }
    }
    // Size changes clamp at log(1000 / 16): 10 * 62.5 = 625 wide at most.
    let huge = decode(&anchor, &[0.0, 0.0, 10.0, -10.0], None);
    assert!(close(huge[2] - huge[0], 625.0, 1e-4), "{huge:?}");
    assert!(close(huge[3] - huge[1], 10.0 / 62.5, 1e-4), "{huge:?}");
    // Clipped to the image ([height, width]).
    let clipped = decode(&anchor, &[0.0, 0.0, 3.0, 3.0], Some([40.0, 30.0]));
    assert_eq!(clipped, [0.0, 0.0, 30.0, 40.0]);
}

#[test]
fn the_iou_matrix_matches_hand_computed_overlaps() {
    let a = [[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 15.0, 15.0]];
    let b = [
        [5.0, 5.0, 15.0, 15.0],
        [20.0, 20.0, 30.0, 30.0],
        [0.0, 0.0, 10.0, 5.0],
    ];
    let m = iou_matrix(&a, &b);
    let expected = [25.0 / 175.0, 0.0, 0.5, 1.0, 0.0, 0.0];
    for (got, want) in m.iter().zip(expected) {
        assert!(close(*got, want, 1e-6), "{m:?}");
    }
    assert_eq!(
        iou(&[1.0, 1.0, 1.0, 1.0], &[1.0, 1.0, 1.0, 1.0]),
        0.0,
        "empty boxes"
    );
}

#[test]
fn the_assigner_makes_positives_negatives_ignored_and_low_quality_matches() {
    let gts = [[0.0, 0.0, 10.0, 10.0], [100.0, 100.0, 110.0, 130.0]];
    let anchors = [
        [0.0, 0.0, 10.0, 9.0],        // IoU 0.9 with gt 0: positive
        [5.0, 0.0, 15.0, 10.0],       // 1/3: negative
        [2.0, 0.0, 12.0, 10.0],       // 2/3: positive
        [4.0, 0.0, 14.0, 10.0],       // 0.43: between the thresholds, ignored
        [100.0, 100.0, 110.0, 110.0], // 1/3 with gt 1, its best: a low-quality positive
        [0.0, 0.0, 10.0, 10.0],       // on the padding: ignored whatever its IoU
        [200.0, 200.0, 210.0, 210.0], // overlaps nothing: negative
    ];
    let valid = [true, true, true, true, true, false, true];
    let assigner = MaxIoUAssignerConfig::default();
    assert_eq!(
        assigner.assign(&anchors, &valid, &gts),
        vec![
            Assignment::Positive(0),
            Assignment::Negative,
            Assignment::Positive(0),
            Assignment::Ignored,
            Assignment::Positive(1),
            Assignment::Ignored,
            Assignment::Negative,
        ]
    );
    let strict = MaxIoUAssignerConfig {
        match_low_quality: false,
        ..MaxIoUAssignerConfig::default()
    };
    assert_eq!(
        strict.assign(&anchors, &valid, &gts)[4],
        Assignment::Negative
    );
    // No ground truth: every valid anchor is background.
    let none = assigner.assign(&anchors, &valid, &[]);
    assert_eq!(
        none.iter().filter(|a| **a == Assignment::Negative).count(),
        6
    );
    assert_eq!(none[5], Assignment::Ignored);
    // Ties for a ground truth's best IoU all become positive (gt_max_assign_all).
    let twins = [[0.0, 0.0, 20.0, 10.0], [-10.0, 0.0, 10.0, 10.0]];
    let gt = [[0.0, 0.0, 10.0, 10.0]];
    assert_eq!(
        assigner.assign(&twins, &[true, true], &gt),
        vec![Assignment::Positive(0), Assignment::Positive(0)]
    );
}

#[test]
fn focal_loss_value_and_gradient_match_torchvision() {
    // torchvision.ops.sigmoid_focal_loss(x, t, alpha=0.25, gamma=2), float64, and x.grad.
    let x = [0.0f32, 2.0, -1.5, 3.0, -4.0];
    let t = [1.0f32, 0.0, 1.0, 1.0, 0.0];
    let values = [
        0.04332169878499658f32,
        1.2375586345660565,
        0.28431807890479416,
        2.7320831124249216e-05,
        4.403677291401858e-06,
    ];
    let grads = [
        -0.07457169878499659f32,
        0.8075352978363615,
        -0.24035617186759006,
        -7.871796162206977e-05,
        1.301289841615317e-05,
    ];
    let device = Default::default();
    for i in 0..5 {
        let logits = Tensor::<AB, 1>::from_floats([x[i]], &device).require_grad();
        let loss = sigmoid_focal_loss(
            logits.clone(),
            Tensor::from_floats([t[i]], &device),
            Tensor::ones([1], &device),
            2.0,
            0.25,
        );
        let value: f32 = loss.clone().into_scalar();
        assert!(
            close(value, values[i], 1e-5) || (value - values[i]).abs() < 1e-9,
            "loss {i}: {value} vs {}",
            values[i]
        );
        let g = loss.backward();
        let grad: f32 = logits.grad(&g).unwrap().into_scalar();
        assert!(
            (grad - grads[i]).abs() <= 1e-5 * grads[i].abs().max(1e-3),
            "grad {i}: {grad} vs {}",
            grads[i]
        );
    }
    // Weight 0 removes an element.
    let loss: f32 = sigmoid_focal_loss(
        Tensor::<Flex, 1>::from_floats([2.0, 0.0], &device),
        Tensor::from_floats([0.0, 1.0], &device),
        Tensor::from_floats([0.0, 1.0], &device),
        2.0,
        0.25,
    )
    .into_scalar();
    assert!(close(loss, values[0], 1e-5));
}

#[test]
fn nms_keeps_the_best_of_overlapping_boxes_per_class() {
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

fn batch<B: Backend>(device: &B::Device) -> DetectionBatch<B> {
    let meta = |id: &str, pad: [usize; 2]| ImageMeta {
        id: id.into(),
        ori_shape: pad,
        img_shape: pad,
        pad_shape: pad,
        scale_factor: [1.0, 1.0],
        flip: false,
    };
    let images = Tensor::<B, 4>::random(
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
    let device = Default::default();
    let model = small_config(4).init::<Flex>(&device).unwrap();
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
    let device = Default::default();
    let model = small_config(4).init::<Flex>(&device).unwrap();
    let b = batch::<Flex>(&device);
    let sizes = [[12, 16], [6, 8], [3, 4], [2, 2], [1, 1]];
    let t = model.targets(&sizes, &b.metas, &b.gt_bboxes, &b.gt_labels, &device);
    assert!(
        t.num_pos[0] >= 2,
        "each object has an anchor: {:?}",
        t.num_pos
    );
    assert_eq!(t.num_pos[1], 0);
    assert_eq!(t.avg_factor, (t.num_pos[0] + 1) as f32);
    let labels: Vec<f32> = t.labels.clone().sum_dim(1).into_data().to_vec().unwrap();
    assert!(
        labels[3] >= 1.0 && labels[0] >= 1.0 && labels[1] == 0.0 && labels[2] == 0.0,
        "{labels:?}"
    );
    // Image b is 64 x 96 inside the 96 x 128 batch: P3 rows 8.. and columns 12.. are padding.
    let weights: Vec<f32> = t.label_weights.into_data().to_vec().unwrap();
    let a = weights.len() / 2;
    let p3 = |y: usize, x: usize| weights[a + (y * 16 + x) * 9];
    assert_eq!(
        (p3(0, 0), p3(7, 11), p3(8, 0), p3(0, 12)),
        (1.0, 1.0, 0.0, 0.0)
    );
}

fn param_grads(
    model: &impl Module<AB>,
    grads: &burn::backend::autodiff::grads::Gradients,
) -> Vec<(ParamId, Vec<f32>)> {
    struct Collect<'a>(
        &'a burn::backend::autodiff::grads::Gradients,
        Vec<(ParamId, Vec<f32>)>,
    );
    impl ModuleVisitor<AB> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = param.val().grad(self.0) {
                self.1
                    .push((param.id, g.into_data().convert::<f32>().to_vec().unwrap()));
            }
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

/// Checkpointing the backbone (by its config key) leaves every gradient bit-identical; the neck
/// and the head (each by its own key), or the whole detector at once, leave them equal to
/// rounding: where a tensor is read by three ops across a segment's edge (C3 by a block's two
/// convs and the neck, with the backbone plain) or a weight is shared by ten segments (the
/// head's), Burn sums the gradients in another order. The neck is one segment and the head one
/// per level and branch, so their keys alone recompute `1 + 2 x levels` times.
#[test]
fn checkpointing_any_part_leaves_the_detectors_gradients_unchanged() {
    use memsave::train::TrainModel;
    let device = Default::default();
    struct Materialise;
    impl<B: Backend> burn::module::ModuleMapper<B> for Materialise {}
    let config = small_config(4);
    let levels = config.neck.num_outs as u64;
    // Materialised before building the others from its weights: lazily initialised parameters
    // would draw twice.
    let plain = config.init::<AB>(&device).unwrap().map(&mut Materialise);
    let b = batch::<AB>(&device);
    let g_plain = plain.loss(b.clone()).backward();
    let reference = param_grads(&plain, &g_plain);
    assert!(reference.len() > 20);
    let with = |backbone: bool, neck: bool, head: bool| {
        let mut config = small_config(4);
        config.backbone = config.backbone.with_with_cp(backbone);
        config.neck.with_cp = neck;
        config.bbox_head.with_cp = head;
        // The same weights as `plain`, the flags from the config.
        config
            .init::<AB>(&device)
            .unwrap()
            .load_record(plain.clone().into_record())
    };
    // The backbone's 8 blocks but layer1's (frozen) and layer2.0 (its input, layer1's output,
    // needs no gradient: MMCV's guard runs it plainly): 5.
    let backbone = 5;
    // The largest difference allowed, relative to each parameter's largest gradient: a few
    // float32 roundings (measured: at most 4.0e-7).
    let rounding = 1e-6;
    let cases = [
        ("the backbone", with(true, false, false), backbone, 0.0),
        (
            "the neck and the head",
            with(false, true, true),
            1 + 2 * levels,
            rounding,
        ),
        ("the neck", with(false, true, false), 1, rounding),
        ("the head", with(false, false, true), 2 * levels, rounding),
        (
            "everything (set_with_cp)",
            memsave::checkpoint::set_with_cp(plain.clone(), true),
            backbone + 1 + 2 * levels,
            rounding,
        ),
    ];
    let mut worst = Vec::new();
    for (what, model, recomputations, bound) in cases {
        let before = memsave::checkpoint::recomputations();
        let grads = model.loss(b.clone()).backward();
        memsave::checkpoint::join_helpers().unwrap();
        let done = memsave::checkpoint::recomputations() - before;
        assert_eq!(done, recomputations, "{what}: recomputations");
        let got = param_grads(&model, &grads);
        assert_eq!(reference.len(), got.len());
        let mut case_worst = 0.0f32;
        for ((id, x), (_, y)) in reference.iter().zip(&got) {
            let diff = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            let scale = x.iter().map(|p| p.abs()).fold(f32::MIN_POSITIVE, f32::max);
            let relative = diff / scale;
            assert!(
                relative <= bound,
                "{what}: parameter {id}: max difference {diff:e} of {scale:e}"
            );
            case_worst = case_worst.max(relative);
        }
        worst.push(format!("{what} {case_worst:.1e}"));
    }
    eprintln!(
        "RetinaNet checkpointed vs plain, worst relative gradient difference: {}",
        worst.join(", ")
    );
    let paths = memsave::checkpoint::segment_paths(&plain);
    assert!(
        paths.contains(&"neck".to_string()) && paths.contains(&"bbox_head".to_string()),
        "{paths:?}"
    );
}

#[test]
fn the_detector_in_half_precision_gives_the_fp32_loss_and_gradients() {
    use memsave::fp16::{wrap_fp16_model, Precision};
    use memsave::train::TrainModel;
    // The same weights in every run, whatever else draws from Flex's process-wide random
    // stream meanwhile (tests run in parallel): each parameter redrawn from a seeded generator,
    // constants (the classifier's prior bias, BatchNorm's ones) kept.
    struct Seeded(u64);
    impl<B: Backend> burn::module::ModuleMapper<B> for Seeded {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.shape();
            let values: Vec<f32> = tensor
                .clone()
                .into_data()
                .convert::<f32>()
                .to_vec()
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
            let value = Tensor::<B, D>::from_data(data, &tensor.device());
            let value = if tensor.is_require_grad() {
                value.require_grad()
            } else {
                value
            };
            burn::module::Param::from_mapped_value(id, value, mapper)
        }
    }
    let device = Default::default();
    let fp32 = small_config(4)
        .init::<AB>(&device)
        .unwrap()
        .map(&mut Seeded(11));
    let mut b = batch::<AB>(&device);
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
        for ((_, x), (_, y)) in a.iter().zip(&b) {
            for (p, q) in x.iter().zip(y) {
                diff += ((p - q) as f64).powi(2);
                norm += (*p as f64).powi(2);
            }
        }
        let relative = (diff / norm).sqrt();
        println!("{precision:?}: loss {v16} vs {v32}, gradients {relative:.2e}");
        assert!(relative <= 5e-2, "{precision:?}: gradients {relative:.2e}");
    }
}

/// With the backbone's segments pinned by path, the neck's and head's own keys join the list,
/// and every path names a segment of the built detector.
#[test]
fn the_neck_and_head_keys_join_a_pinned_list_of_segments() {
    use memsave::planner::WithCp;
    let mut config = small_config(4);
    config.backbone.with_cp = WithCp::Paths(vec!["backbone.layer4.1".into()]);
    assert_eq!(config.with_cp(), config.backbone.with_cp);
    config.neck.with_cp = true;
    config.bbox_head.with_cp = true;
    let WithCp::Paths(paths) = config.with_cp() else {
        panic!("a list stays a list");
    };
    assert_eq!(paths, ["backbone.layer4.1", "neck", "bbox_head"]);
    let model = config.init::<AB>(&Default::default()).unwrap();
    memsave::checkpoint::set_with_cp_paths(model, &paths).unwrap();
    config.backbone.with_cp = WithCp::Auto;
    let error = config.check().unwrap_err().to_string();
    assert!(error.contains("neck.with_cp"), "{error}");
}
