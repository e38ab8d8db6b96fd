//! The ResNet on Burn 0.22: its shapes, every block checkpointed giving the plain network's
//! gradients and running statistics bit for bit under both of Burn's checkpointing strategies,
//! MMDetection's `frozen_stages` and `norm_eval`, frozen stages held in int8, and the settings'
//! errors.

use crate::common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::{Distribution, Gradients};
use common::watchdog;
use memsave_models_next::resnet::{ResNet, ResNetConfig};
use memsave_next::checkpoint::set_with_cp;

fn devices() -> [(&'static str, Device); 2] {
    [
        ("Burn's checkpointing off", Device::flex().autodiff()),
        (
            "Burn's Balanced checkpointing",
            Device::flex().autodiff().gradient_checkpointing(),
        ),
    ]
}

fn bits<const D: usize>(t: Tensor<D>) -> Vec<u32> {
    t.into_data().iter::<f32>().map(f32::to_bits).collect()
}

/// Every float's gradient (`None` without one) and every value (running statistics among
/// them, read from `valid()`, which merges their last update: a visit alone reads a running
/// state without it), as bits, in visiting order.
fn state(model: &ResNet, grads: &Gradients) -> (Vec<Option<Vec<u32>>>, Vec<Vec<u32>>) {
    struct Grads<'a>(&'a Gradients, Vec<Option<Vec<u32>>>);
    impl ModuleVisitor for Grads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.1.push(param.val().grad(self.0).map(bits));
        }
    }
    struct Values(Vec<Vec<u32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(bits(param.val()));
        }
    }
    let mut grads = Grads(grads, Vec::new());
    model.visit(&mut grads);
    let mut values = Values(Vec::new());
    model.valid().visit(&mut values);
    (grads.1, values.0)
}

/// A small network of `depth` (8 base channels, the last stage's features), as built on
/// `device` from seed 1.
fn small(depth: usize, device: &Device) -> ResNet {
    device.seed(1);
    ResNetConfig::new(depth)
        .with_base_channels(8)
        .init(device)
        .unwrap()
}

fn step(model: &ResNet, device: &Device) -> (Vec<Option<Vec<u32>>>, Vec<Vec<u32>>) {
    device.seed(2);
    let images = Tensor::<4>::random([2, 3, 32, 32], Distribution::Default, device).require_grad();
    let features = model.forward(images);
    let loss = features
        .into_iter()
        .map(|f| f.powi_scalar(2).mean())
        .reduce(|a, b| a + b)
        .unwrap();
    let grads = loss.backward();
    state(model, &grads)
}

#[test]
fn shapes_follow_the_stages() {
    watchdog(300, || {
        let device = Device::flex().autodiff();
        for (depth, blocks, expansion) in [(18, [2, 2, 2, 2], 1), (50, [3, 4, 6, 3], 4)] {
            let images = Tensor::<4>::zeros([1, 3, 64, 64], &device);
            let model = ResNetConfig::new(depth)
                .with_base_channels(8)
                .with_out_indices(vec![1, 3])
                .init(&device)
                .unwrap();
            assert_eq!(model.blocks(), blocks);
            let dims: Vec<[usize; 4]> = model.forward(images).iter().map(Tensor::dims).collect();
            assert_eq!(
                dims,
                [[1, 16 * expansion, 8, 8], [1, 64 * expansion, 2, 2]],
                "ResNet-{depth}"
            );
        }
        let error = ResNetConfig::new(20)
            .init(&device)
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("`depth`") && error.contains("20"), "{error}");
    });
}

#[test]
fn every_block_checkpointed_trains_as_plain_bit_for_bit() {
    watchdog(300, || {
        for depth in [18, 50] {
            for (name, device) in devices() {
                // A model each: running statistics are shared by a module's clones.
                let (plain_grads, plain_values) = step(&small(depth, &device), &device);
                let checkpointed = set_with_cp(small(depth, &device), true);
                let (grads, values) = step(&checkpointed, &device);
                assert!(plain_grads.iter().filter(|g| g.is_some()).count() > 10);
                let first = plain_grads.iter().zip(&grads).position(|(a, b)| a != b);
                assert_eq!(
                    first, None,
                    "ResNet-{depth}, {name}: the first parameter whose gradient differs"
                );
                let first = plain_values.iter().zip(&values).position(|(a, b)| a != b);
                assert_eq!(
                    first, None,
                    "ResNet-{depth}, {name}: the first value that differs"
                );
            }
        }
    });
}

/// The values of `module`'s floats as bits (running statistics with their last update, read
/// from `valid()`).
fn values<M: Module>(module: &M) -> Vec<Vec<u32>> {
    struct Values(Vec<Vec<u32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(bits(param.val().dequantize()));
        }
    }
    let mut found = Values(Vec::new());
    module.valid().visit(&mut found);
    found.0
}

#[test]
fn frozen_stages_take_no_gradient_and_keep_their_statistics_and_norm_eval_keeps_every_one() {
    watchdog(300, || {
        let device = Device::flex().autodiff();
        device.seed(1);
        let model = ResNetConfig::new(50)
            .with_base_channels(8)
            .with_frozen_stages(1)
            .init(&device)
            .unwrap();
        let before = values(&model);
        let (grads, after) = step(&model, &device);
        // The stem (conv, BN's two weights and two statistics) and layer1 (3 bottlenecks of 3
        // convs and 3 BNs, and a downsample) are frozen.
        let frozen = 5 + 3 * 15 + 5;
        assert!(grads[..frozen].iter().all(Option::is_none));
        assert!(grads[frozen..].iter().any(Option::is_some));
        assert_eq!(
            before[..frozen],
            after[..frozen],
            "the frozen statistics moved"
        );
        assert_ne!(
            before[frozen..],
            after[frozen..],
            "layer2's statistics stay"
        );

        device.seed(1);
        let model = ResNetConfig::new(50)
            .with_base_channels(8)
            .with_norm_eval(true)
            .init(&device)
            .unwrap();
        let before = values(&model);
        let (grads, after) = step(&model, &device);
        assert!(grads.iter().any(Option::is_some));
        // Only the weights moved: every statistic is as it was (the step computes gradients only,
        // so the values are the same everywhere).
        assert_eq!(before, after, "a statistic moved under norm_eval");
    });
}

#[test]
fn int8_frozen_stages_train_as_their_int8_values() {
    watchdog(300, || {
        use memsave_next::frozen::{compress_frozen, int8_scheme, FrozenDtype};
        for (name, device) in devices() {
            let build = || {
                device.seed(1);
                ResNetConfig::new(50)
                    .with_base_channels(8)
                    .with_frozen_stages(1)
                    .init(&device)
                    .unwrap()
            };
            let (int8, figures) = compress_frozen(build(), FrozenDtype::Int8);
            // The stem's convolution, layer1's nine and its downsample's.
            assert_eq!(figures.count, 11, "{name}");
            struct Round;
            impl burn::module::ModuleMapper for Round {
                fn map_float<const D: usize>(
                    &mut self,
                    param: Param<Tensor<D>>,
                ) -> Param<Tensor<D>> {
                    if D < 2 || param.val().is_require_grad() {
                        return param;
                    }
                    param.map(|t| t.quantize_dynamic(&int8_scheme()).dequantize())
                }
            }
            let rounded = build().map(&mut Round);
            let (a, _) = step(&int8, &device);
            let (b, _) = step(&rounded, &device);
            assert!(a.iter().filter(|g| g.is_some()).count() > 10);
            assert_eq!(
                a, b,
                "{name}: the gradients of the int8 frozen stages' network"
            );
            // The int8 values are read: the fp32 frozen stages give other gradients.
            let (c, _) = step(&build(), &device);
            assert_ne!(a, c, "{name}");
        }
    });
}

#[test]
fn bad_backbone_settings_name_their_field() {
    let _turn = common::one_at_a_time();
    let device = Device::flex().autodiff();
    let error = ResNetConfig::new(50)
        .with_frozen_stages(5)
        .init(&device)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("frozen_stages"), "{error}");
    let mut config = ResNetConfig::new(50);
    config.init_cfg = Some(memsave_models_next::resnet::InitCfg::Pretrained {
        checkpoint: "resnet50.pth".into(),
    });
    let error = config.init(&device).err().unwrap().to_string();
    // Loaded since torchvision's weights came to Burn 0.22: an absent file is named.
    assert!(
        error.contains("resnet50.pth") && error.contains("no such file"),
        "{error}"
    );
}

#[test]
fn caffe_style_moves_the_stride_to_the_first_convolution() {
    let _turn = common::one_at_a_time();
    use memsave_models_next::resnet::{InitCfg, Style};
    let device = Device::flex();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/resnet50_w8.safetensors");
    let config = |style| ResNetConfig {
        style,
        base_channels: 8,
        init_cfg: Some(InitCfg::Pretrained {
            checkpoint: fixture.clone(),
        }),
        ..ResNetConfig::default()
    };
    let images = Tensor::<4>::random([1, 3, 64, 64], Distribution::Normal(0.0, 1.0), &device);
    let pytorch = config(Style::Pytorch)
        .init(&device)
        .unwrap()
        .forward(images.clone());
    let caffe = config(Style::Caffe).init(&device).unwrap().forward(images);
    // The same weights, the same shapes; only C2 (no stride in stage 1) agrees.
    for (stage, (a, b)) in pytorch.into_iter().zip(caffe).enumerate() {
        assert_eq!(a.dims(), b.dims());
        let diff: f32 = (a - b).abs().max().into_scalar();
        assert_eq!(diff > 1e-4, stage > 0, "C{}: difference {diff}", stage + 2);
    }
    let basic = ResNetConfig {
        style: Style::Caffe,
        base_channels: 8,
        ..ResNetConfig::new(18)
    };
    assert!(
        basic.init(&device).is_ok(),
        "basic blocks have no 1x1 convolution: the style changes nothing"
    );
}
