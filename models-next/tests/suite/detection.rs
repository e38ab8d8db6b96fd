//! RetinaNet's pieces on Burn 0.22 (`memsave_models_next::detection`), as on Burn 0.21: the
//! anchors, the box coder, the overlaps and the assigner against MMDetection's formulas and
//! hand-computed values, the focal loss against torchvision; the neck and the head: their
//! shapes, the head's initial scores at the prior, and each with every segment checkpointed
//! giving the plain gradients bit for bit under both of Burn's checkpointing strategies.

use crate::common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::Distribution;
use common::watchdog;
use memsave_models_next::detection::anchors::AnchorGeneratorConfig;
use memsave_models_next::detection::assigner::{Assignment, MaxIoUAssignerConfig};
use memsave_models_next::detection::boxes::{iou, iou_matrix};
use memsave_models_next::detection::coder::{decode, encode};
use memsave_models_next::detection::fpn::FpnConfig;
use memsave_models_next::detection::head::RetinaHeadConfig;
use memsave_models_next::detection::losses::sigmoid_focal_loss;
use memsave_next::checkpoint::set_with_cp;
use memsave_next::memory;

fn close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

#[test]
fn anchors_of_a_level_follow_mmdetections_generator() {
    let _turn = common::one_at_a_time();
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
    let _turn = common::one_at_a_time();
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
    let _turn = common::one_at_a_time();
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
    let _turn = common::one_at_a_time();
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
    let _turn = common::one_at_a_time();
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
    let device = Device::flex().autodiff();
    for i in 0..5 {
        let logits = Tensor::<1>::from_floats([x[i]], &device).require_grad();
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
        Tensor::<1>::from_floats([2.0, 0.0], &device),
        Tensor::from_floats([0.0, 1.0], &device),
        Tensor::from_floats([0.0, 1.0], &device),
        2.0,
        0.25,
    )
    .into_scalar();
    assert!(close(loss, values[0], 1e-5));
}

/// Every float parameter's gradient as bits, in visiting order (`None` where it has none).
fn grad_bits<M: Module>(model: &M, grads: &burn::tensor::Gradients) -> Vec<Option<Vec<u32>>> {
    struct Collect<'a>(&'a burn::tensor::Gradients, Vec<Option<Vec<u32>>>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.1.push(param.val().grad(self.0).map(|g| {
                g.into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(f32::to_bits)
                    .collect()
            }));
        }
    }
    let mut collect = Collect(grads, Vec::new());
    model.visit(&mut collect);
    collect.1
}

/// Flex with autodiff under each of Burn's checkpointing strategies.
fn devices() -> [(&'static str, Device); 2] {
    [
        ("Burn's checkpointing off", Device::flex().autodiff()),
        (
            "Burn's Balanced checkpointing",
            Device::flex().autodiff().gradient_checkpointing(),
        ),
    ]
}

/// A small pyramid: C2..C5 of 8, 16, 32, 64 channels at strides 4..32 of a 256 x 384 image,
/// RetinaNet's FPN (P3..P7 of 16 channels, extra convs on the input).
fn small_fpn() -> FpnConfig {
    FpnConfig {
        in_channels: vec![8, 16, 32, 64],
        out_channels: 16,
        ..FpnConfig::default()
    }
}

fn backbone_levels(device: &Device) -> Vec<Tensor<4>> {
    [(8, 64, 96), (16, 32, 48), (32, 16, 24), (64, 8, 12)]
        .into_iter()
        .map(|(c, h, w)| {
            Tensor::<4>::random([2, c, h, w], Distribution::Default, device).require_grad()
        })
        .collect()
}

#[test]
fn the_neck_gives_five_levels_and_its_segment_the_plain_gradients() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            device.seed(4);
            let fpn = small_fpn().init(&device).unwrap();
            let inputs = backbone_levels(&device);
            let meter = memory::meter_for(&device).unwrap();
            let run = |with_cp: bool| {
                let fpn = set_with_cp(fpn.clone(), with_cp);
                let before = meter.live();
                let outs = fpn.forward(inputs.clone());
                let kept = meter.live().saturating_sub(before);
                let shapes: Vec<[usize; 4]> = outs.iter().map(|o| o.dims()).collect();
                let loss = outs
                    .into_iter()
                    .enumerate()
                    .map(|(i, o)| o.powi_scalar(2).sum().mul_scalar(1.0 + i as f64))
                    .reduce(|a, b| a + b)
                    .unwrap();
                let grads = memsave_next::checkpoint::backward(loss);
                (shapes, grad_bits(&fpn, &grads), kept)
            };
            let (shapes, plain, kept_plain) = run(false);
            assert_eq!(
                shapes,
                [
                    [2, 16, 32, 48],
                    [2, 16, 16, 24],
                    [2, 16, 8, 12],
                    [2, 16, 4, 6],
                    [2, 16, 2, 3]
                ],
                "{strategy}"
            );
            let (_, checkpointed, kept) = run(true);
            assert!(
                plain.iter().all(Option::is_some),
                "{strategy}: every parameter has one"
            );
            assert_eq!(plain, checkpointed, "{strategy}");
            // The switch is read: the pyramid's laterals and sums are not kept.
            println!("{strategy}: the neck keeps {kept} bytes checkpointed, {kept_plain} plain");
            assert!(
                kept * 4 < kept_plain * 3,
                "{strategy}: {kept} kept against {kept_plain}"
            );
        }
    });
}

#[test]
fn the_head_starts_at_the_prior_and_its_segments_give_the_plain_gradients() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            device.seed(5);
            let config = RetinaHeadConfig {
                num_classes: 3,
                in_channels: 16,
                feat_channels: 16,
                stacked_convs: 2,
                ..RetinaHeadConfig::default()
            };
            let head = config.init(&device).unwrap();
            let feats: Vec<Tensor<4>> = [(32, 48), (16, 24)]
                .into_iter()
                .map(|(h, w)| {
                    Tensor::<4>::random([2, 16, h, w], Distribution::Default, &device)
                        .require_grad()
                })
                .collect();
            let meter = memory::meter_for(&device).unwrap();
            let run = |with_cp: bool| {
                let head = set_with_cp(head.clone(), with_cp);
                let before = meter.live();
                let outs = head.forward(feats.clone());
                let kept = meter.live().saturating_sub(before);
                let first = outs[0].0.clone();
                let loss = outs
                    .into_iter()
                    .map(|(cls, reg)| cls.powi_scalar(2).sum() + reg.abs().sum())
                    .reduce(|a, b| a + b)
                    .unwrap();
                let grads = memsave_next::checkpoint::backward(loss);
                (first, grad_bits(&head, &grads), kept)
            };
            let (first, plain, kept_plain) = run(false);
            // Location-major: 32 x 48 locations x 9 anchors, 3 classes; every score at the prior.
            assert_eq!(first.dims(), [2, 32 * 48 * 9, 3]);
            let scores = burn::tensor::activation::sigmoid(first)
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            assert!(scores.iter().all(|s| (s - 0.01).abs() < 2e-3), "{strategy}");
            let (_, checkpointed, kept) = run(true);
            assert_eq!(plain, checkpointed, "{strategy}");
            // The switch is read: the stacked convs' activations are not kept.
            println!("{strategy}: the head keeps {kept} bytes checkpointed, {kept_plain} plain");
            assert!(
                kept * 4 < kept_plain * 3,
                "{strategy}: {kept} kept against {kept_plain}"
            );
        }
    });
}

#[test]
fn bad_neck_and_head_settings_name_their_field() {
    let _turn = common::one_at_a_time();
    let device = Device::flex().autodiff();
    let fpn = FpnConfig {
        start_level: 4,
        ..small_fpn()
    };
    let error = fpn.init(&device).unwrap_err().to_string();
    assert!(error.contains("start_level"), "{error}");
    let head = RetinaHeadConfig {
        num_classes: 0,
        ..RetinaHeadConfig::default()
    };
    let error = head.init(&device).unwrap_err().to_string();
    assert!(error.contains("num_classes"), "{error}");
}
