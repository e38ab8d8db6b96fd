//! Weights from PyTorch: a torchvision-layout ResNet state dict (`torch.save(model.state_dict())`
//! as `.pth`/`.pt`, or `.safetensors`) into memsave's ResNet (`crate::resnet::ResNet`, whose
//! config loads its `init_cfg` through here), through burn-store (0.22.1).
//!
//! torchvision's names are mapped onto ours (`conv1` -> `stem.conv`, `bn1` -> `stem.bn`,
//! `downsample.0`/`.1` -> `downsample.conv`/`.bn`, BN `weight`/`bias` -> `gamma`/`beta`). The
//! classifier's `fc` and BN's `num_batches_tracked` are torchvision's alone and are left out, as
//! MMCV's `load_checkpoint` reports them as unexpected and goes on. Any other key that matches
//! nothing, any parameter of ours that the file lacks, and any shape that differs is an error
//! that lists every one of them.

use std::path::Path;

use burn_store::{
    KeyRemapper, ModuleSnapshot, PyTorchToBurnAdapter, PytorchStore, SafetensorsStore,
};

use crate::memsave::{Error, Result};

/// torchvision key patterns and ours.
const RENAMES: &[(&str, &str)] = &[
    (r"^conv1\.(.*)$", "stem.conv.$1"),
    (r"^bn1\.(.*)$", "stem.bn.$1"),
    (
        r"^(layer\d+\.\d+)\.downsample\.0\.(.*)$",
        "$1.downsample.conv.$2",
    ),
    (
        r"^(layer\d+\.\d+)\.downsample\.1\.(.*)$",
        "$1.downsample.bn.$2",
    ),
    // After the renames above every BN's path ends in `bn` or `bnK`.
    (r"^(.*\.bn\d?)\.weight$", "$1.gamma"),
    (r"^(.*\.bn\d?)\.bias$", "$1.beta"),
];

/// Keys of a torchvision ResNet that a backbone does not have.
fn torchvision_only(key: &str) -> bool {
    key.starts_with("fc.") || key.ends_with("num_batches_tracked")
}

/// `model` (a ResNet of ours: its parameter paths are what torchvision's keys are renamed to)
/// with the weights of the torchvision ResNet state dict at `path`.
pub fn load_torchvision_resnet<M: ModuleSnapshot>(mut model: M, path: &Path) -> Result<M> {
    let bad = |message: String| Error::snapshot(path, message);
    // burn-store's error, kept as the cause.
    let unreadable = |error: Box<dyn std::error::Error + Send + Sync>| Error::Snapshot {
        path: path.to_path_buf(),
        message: error.to_string(),
        source: Some(memsave_next::snapshot::SnapshotCause::Other(error)),
    };
    let text = path.display().to_string();
    if text.contains("://") {
        return Err(bad(
            "memsave does not download weights: give the path of a torchvision state dict \
             (`.pth` or `.safetensors`) on this machine"
                .to_string(),
        ));
    }
    if !path.is_file() {
        return Err(bad("no such file".to_string()));
    }
    let mut remapper = KeyRemapper::new();
    for (from, to) in RENAMES {
        remapper = remapper
            .add_pattern(*from, *to)
            .expect("the rename patterns are valid regexes");
    }
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let result = match extension.as_str() {
        "safetensors" => {
            let mut store = SafetensorsStore::from_file(path)
                .with_from_adapter(PyTorchToBurnAdapter)
                .skip_enum_variants(true)
                .remap(remapper)
                .validate(false)
                .allow_partial(true);
            model
                .load_from(&mut store)
                .map_err(|e| unreadable(Box::new(e)))?
        }
        "pth" | "pt" | "bin" => {
            let mut store = PytorchStore::from_file(path)
                .remap(remapper)
                .map_indices_contiguous(false)
                .validate(false)
                .allow_partial(true);
            model
                .load_from(&mut store)
                .map_err(|e| unreadable(Box::new(e)))?
        }
        other => {
            return Err(bad(format!(
                "unknown weight format `.{other}`: use a PyTorch state dict (`.pth`, `.pt`) or \
                 `.safetensors`"
            )))
        }
    };
    let mut problems = Vec::new();
    let unexpected: Vec<&String> = result
        .unused
        .iter()
        .filter(|key| !torchvision_only(key))
        .collect();
    if !unexpected.is_empty() {
        problems.push(format!(
            "keys that match no parameter of the ResNet: {}",
            list(&unexpected)
        ));
    }
    if !result.missing.is_empty() {
        let missing: Vec<&String> = result.missing.iter().map(|(path, _)| path).collect();
        problems.push(format!("parameters the file lacks: {}", list(&missing)));
    }
    if !result.errors.is_empty() {
        let errors: Vec<String> = result.errors.iter().map(ToString::to_string).collect();
        problems.push(format!("{}", errors.join("; ")));
    }
    if problems.is_empty() {
        Ok(model)
    } else {
        Err(bad(format!(
            "not the weights of this ResNet (depth, base_channels, style?): {}",
            problems.join("; ")
        )))
    }
}

fn list<T: std::fmt::Display>(items: &[T]) -> String {
    const SHOWN: usize = 12;
    let mut text: Vec<String> = items.iter().take(SHOWN).map(|i| format!("`{i}`")).collect();
    if items.len() > SHOWN {
        text.push(format!("and {} more", items.len() - SHOWN));
    }
    text.join(", ")
}
