//! Weights from PyTorch on Burn 0.22: torchvision-layout state dicts (memsave-models' fixtures,
//! made by `scripts/make_resnet_fixtures.py`) load into our ResNet, whose forward then matches
//! torchvision's feature maps; files that do not fit are errors listing what is wrong.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use memsave_models_next::resnet::{InitCfg, ResNetConfig};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures")
        .join(name)
}

/// The named tensors of a safetensors file, as shapes and f32 values.
fn read_features(name: &str) -> std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture(name)).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(key, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (key, (view.shape().to_vec(), values))
        })
        .collect()
}

fn pretrained(depth: usize, base: usize, file: &str) -> ResNetConfig {
    ResNetConfig {
        depth,
        base_channels: base,
        init_cfg: Some(InitCfg::Pretrained {
            checkpoint: fixture(file),
        }),
        ..ResNetConfig::default()
    }
}

fn check_against_torchvision(config: &ResNetConfig, features: &str) {
    // Loaded for inference and for training (autodiff: Burn 0.22's parameters there are lazy
    // until first read, and the store must fill them all the same).
    check_on(config, features, Device::flex());
    check_on(config, features, Device::flex().autodiff());
}

fn check_on(config: &ResNetConfig, features: &str, device: Device) {
    let autodiff = device.is_autodiff();
    let model = config.init(&device).unwrap();
    if autodiff {
        // Loaded weights still train: the parameters a fresh model trains (not the running
        // statistics, which are parameters without gradient).
        struct Trainable(usize, usize);
        impl burn::module::ModuleVisitor for Trainable {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
                self.0 += 1;
                self.1 += param.val().is_require_grad() as usize;
            }
        }
        let count = |model: &memsave_models_next::resnet::ResNet| {
            let mut trainable = Trainable(0, 0);
            model.visit(&mut trainable);
            (trainable.0, trainable.1)
        };
        let mut fresh = config.clone();
        fresh.init_cfg = None;
        let fresh = count(&fresh.init(&device).unwrap());
        assert_eq!(count(&model), fresh, "(parameters, trainable)");
        assert!(fresh.1 > fresh.0 / 2, "{fresh:?}");
    }
    // torchvision's features are eval mode's (running statistics): `valid()` is Burn's.
    let model = model.valid();
    let device = device.inner();
    let reference = read_features(features);
    let (shape, values) = &reference["input"];
    let input = Tensor::<4>::from_data(
        TensorData::new(values.clone(), [shape[0], shape[1], shape[2], shape[3]]),
        &device,
    );
    let ours = model.forward(input);
    for (stage, ours) in ours.into_iter().enumerate() {
        let (shape, expected) = &reference[&format!("c{}", stage + 2)];
        assert_eq!(&ours.dims().to_vec(), shape, "C{}", stage + 2);
        let ours: Vec<f32> = ours.into_data().try_to_vec().unwrap();
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (a, b) in ours.iter().zip(expected) {
            diff += ((a - b) as f64).powi(2);
            norm += (*b as f64).powi(2);
        }
        let relative = (diff / norm).sqrt();
        println!(
            "{features} C{} (loaded with autodiff: {}): relative error {relative:.2e}",
            stage + 2,
            autodiff
        );
        assert!(
            relative <= 1e-4,
            "C{}: relative error {relative:.2e}",
            stage + 2
        );
    }
}

#[test]
fn a_torchvision_resnet18_state_dict_in_pth_gives_torchvisions_features() {
    let _turn = super::common::one_at_a_time();
    check_against_torchvision(
        &pretrained(18, 16, "resnet18_w16.pth"),
        "resnet18_w16_features.safetensors",
    );
}

#[test]
fn a_torchvision_resnet50_state_dict_in_safetensors_gives_torchvisions_features() {
    let _turn = super::common::one_at_a_time();
    check_against_torchvision(
        &pretrained(50, 8, "resnet50_w8.safetensors"),
        "resnet50_w8_features.safetensors",
    );
}

#[test]
fn a_state_dict_of_another_architecture_is_an_error_listing_the_keys() {
    let _turn = super::common::one_at_a_time();
    // ResNet-34 has more blocks than the ResNet-18 file holds; base 32 makes every shape differ.
    let error = pretrained(34, 16, "resnet18_w16.pth")
        .init(&Device::flex())
        .unwrap_err()
        .to_string();
    assert!(error.contains("resnet18_w16.pth"), "{error}");
    assert!(error.contains("parameters the file lacks"), "{error}");
    assert!(error.contains("layer1.2"), "{error}");
    let error = pretrained(18, 32, "resnet18_w16.pth")
        .init(&Device::flex())
        .unwrap_err()
        .to_string();
    assert!(error.to_lowercase().contains("shape"), "{error}");
    assert!(error.contains("stem.conv.weight"), "{error}");
}

#[test]
fn missing_damaged_remote_or_unknown_files_are_errors_naming_them() {
    let _turn = super::common::one_at_a_time();
    let device = Device::flex();
    let dir = tempfile::tempdir().unwrap();
    let damaged = dir.path().join("damaged.pth");
    std::fs::write(&damaged, b"not a pickle").unwrap();
    let damaged_st = dir.path().join("damaged.safetensors");
    std::fs::write(&damaged_st, b"\x08\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    let unknown = dir.path().join("weights.h5");
    std::fs::write(&unknown, b"").unwrap();
    for (path, words) in [
        (dir.path().join("absent.pth"), "no such file"),
        (damaged.clone(), "damaged.pth"),
        (damaged_st.clone(), "damaged.safetensors"),
        (unknown.clone(), "unknown weight format"),
        (
            PathBuf::from("https://download.pytorch.org/models/resnet50.pth"),
            "does not download",
        ),
    ] {
        let config = ResNetConfig {
            depth: 18,
            base_channels: 16,
            init_cfg: Some(InitCfg::Pretrained {
                checkpoint: path.clone(),
            }),
            ..ResNetConfig::default()
        };
        let error = config.init(&device).unwrap_err().to_string();
        assert!(error.contains(words), "{}: {error}", path.display());
        assert!(
            error.contains(path.file_name().unwrap().to_str().unwrap()),
            "{error}"
        );
    }
}
