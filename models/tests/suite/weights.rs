//! Weights from PyTorch: torchvision-layout state dicts (fixtures made by
//! `scripts/make_resnet_fixtures.py`) load into our ResNet, whose forward then matches
//! torchvision's feature maps; files that do not fit are errors listing what is wrong.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::prelude::*;
use memsave_models::resnet::{InitCfg, ResNetConfig};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
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
    let device = Default::default();
    let model = config.init::<Flex>(&device).unwrap();
    let reference = read_features(features);
    let (shape, values) = &reference["input"];
    let input = Tensor::<Flex, 4>::from_data(
        TensorData::new(values.clone(), [shape[0], shape[1], shape[2], shape[3]]),
        &device,
    );
    let ours = model.forward(input);
    for (stage, ours) in ours.into_iter().enumerate() {
        let (shape, expected) = &reference[&format!("c{}", stage + 2)];
        assert_eq!(&ours.dims().to_vec(), shape, "C{}", stage + 2);
        let ours: Vec<f32> = ours.into_data().to_vec().unwrap();
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (a, b) in ours.iter().zip(expected) {
            diff += ((a - b) as f64).powi(2);
            norm += (*b as f64).powi(2);
        }
        let relative = (diff / norm).sqrt();
        println!("{features} C{}: relative error {relative:.2e}", stage + 2);
        assert!(
            relative <= 1e-4,
            "C{}: relative error {relative:.2e}",
            stage + 2
        );
    }
}

#[test]
fn a_torchvision_resnet18_state_dict_in_pth_gives_torchvisions_features() {
    check_against_torchvision(
        &pretrained(18, 16, "resnet18_w16.pth"),
        "resnet18_w16_features.safetensors",
    );
}

#[test]
fn a_torchvision_resnet50_state_dict_in_safetensors_gives_torchvisions_features() {
    check_against_torchvision(
        &pretrained(50, 8, "resnet50_w8.safetensors"),
        "resnet50_w8_features.safetensors",
    );
}

#[test]
fn a_state_dict_of_another_architecture_is_an_error_listing_the_keys() {
    // ResNet-34 has more blocks than the ResNet-18 file holds; base 32 makes every shape differ.
    let error = pretrained(34, 16, "resnet18_w16.pth")
        .init::<Flex>(&Default::default())
        .unwrap_err()
        .to_string();
    assert!(error.contains("resnet18_w16.pth"), "{error}");
    assert!(error.contains("parameters the file lacks"), "{error}");
    assert!(error.contains("layer1.2"), "{error}");
    let error = pretrained(18, 32, "resnet18_w16.pth")
        .init::<Flex>(&Default::default())
        .unwrap_err()
        .to_string();
    assert!(error.to_lowercase().contains("shape"), "{error}");
    assert!(error.contains("stem.conv.weight"), "{error}");
}

#[test]
fn missing_damaged_remote_or_unknown_files_are_errors_naming_them() {
    let device = Default::default();
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
        let error = config.init::<Flex>(&device).unwrap_err().to_string();
        assert!(error.contains(words), "{}: {error}", path.display());
        assert!(
            error.contains(path.file_name().unwrap().to_str().unwrap()),
            "{error}"
        );
    }
}
