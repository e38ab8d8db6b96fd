//! The `memsave` command line: a short run, a resume, and bad input reported without a panic.

use crate::common;

use std::path::PathBuf;
use std::process::Output;

use common::memsave;

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("cli", name)
}

const TINY: &str = r#"
_base_ = "BASE"
[data]
type = "SyntheticClassification"
samples_per_gpu = 2
num_samples = 4
image_size = 16
[runner]
type = "EpochBasedRunner"
max_epochs = 2
[log_config]
interval = 1
[checkpoint_config]
max_keep_ckpts = -1   # the base config keeps one; these tests resume from the first
"#;

fn tiny_config(dir: &std::path::Path) -> PathBuf {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/resnet18_synthetic.toml");
    let path = dir.join("tiny.toml");
    std::fs::write(&path, TINY.replace("BASE", base.to_str().unwrap())).unwrap();
    path
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn trains_saves_and_resumes_with_each_strategy() {
    let dir = dir("train");
    let config = tiny_config(&dir);
    for (name, set) in common::strategy_overrides("\"dynamic\"") {
        let work_dir = dir.join(name);
        let mut args = vec![
            "train",
            config.to_str().unwrap(),
            "--work-dir",
            work_dir.to_str().unwrap(),
        ];
        args.extend(set.iter().map(String::as_str));
        let output = memsave(&args);
        assert!(output.status.success(), "{name}: {}", text(&output));
        assert!(
            text(&output).contains("Epoch [2][2/2]"),
            "{name}: {}",
            text(&output)
        );
        for file in ["epoch_1.ckpt", "epoch_2.ckpt", "latest.ckpt", "train.log"] {
            assert!(work_dir.join(file).exists(), "{name}: {file}");
        }
        // Log lines carry the loss and the peak memory (the binary counts its heap).
        let log = std::fs::read_to_string(work_dir.join("train.log")).unwrap();
        let last = log
            .lines()
            .rfind(|line| line.starts_with("Epoch [2]"))
            .unwrap();
        assert!(last.contains("loss: "), "{name}: {last}");
        assert!(last.contains("  memory: "), "{name}: {last}");
        // The base config's evaluation: top-1 accuracy on held-out samples after each epoch.
        let val = log
            .lines()
            .find(|line| line.starts_with("Epoch(val) [2]"))
            .unwrap_or_else(|| panic!("{name}: no evaluation in {log}"));
        assert!(val.contains("accuracy_top-1: "), "{name}: {val}");
        assert!(val.contains("(128 held-out samples)"), "{name}: {val}");
    }

    // Resume the plain run from its first epoch: one more epoch to go.
    let work_dir = dir.join("plain");
    let checkpoint = work_dir.join("epoch_1.ckpt");
    let output = memsave(&[
        "train",
        config.to_str().unwrap(),
        "--work-dir",
        work_dir.to_str().unwrap(),
        "--resume",
        checkpoint.to_str().unwrap(),
        "--set",
        "evaluation.num_samples=8",
    ]);
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("resumed from"), "{}", text(&output));
    // The held-out set's size is read (128 by default, as the first runs logged).
    assert!(
        text(&output).contains("(8 held-out samples)"),
        "{}",
        text(&output)
    );
    assert!(
        !text(&output).contains("Epoch [1]"),
        "epoch 1 is not run again: {}",
        text(&output)
    );
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let dir = dir("bad");
    let config = tiny_config(&dir);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--set".into(),
                "optimizer_config.cumulative_iters=\"2\"".into(),
            ],
            "optimizer_config.cumulative_iters",
        ),
        (
            vec!["--set".into(), "model.backbone.depth=42".into()],
            "model.backbone.depth",
        ),
        (
            vec!["--set".into(), "data.image_size=2".into()],
            "data.image_size",
        ),
        (
            vec!["--set".into(), "evaluation.metric=\"mAP\"".into()],
            "evaluation.metric",
        ),
        (
            vec!["--set".into(), "evaluation.num_samples=0".into()],
            "evaluation.num_samples",
        ),
        (
            vec!["--resume".into(), config.to_str().unwrap().into()],
            "not a memsave checkpoint",
        ),
        (
            vec!["--resume".into(), "/no/such/file.ckpt".into()],
            "/no/such/file.ckpt",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec![
            "train".to_string(),
            config.to_str().unwrap().to_string(),
            "--work-dir".into(),
            dir.join("run").to_str().unwrap().to_string(),
        ];
        args.extend(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = memsave(&args);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {}", text(&output));
        let stderr = text(&output);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let output = memsave(&["train", "/no/such/config.toml"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output).contains("/no/such/config.toml"),
        "{}",
        text(&output)
    );
}

#[test]
fn a_step_that_cannot_fit_in_memory_is_an_error_before_anything_is_written() {
    let dir = dir("too-big");
    let config = tiny_config(&dir);
    let work_dir = dir.join("run");
    let output = memsave(&[
        "train",
        config.to_str().unwrap(),
        "--work-dir",
        work_dir.to_str().unwrap(),
        "--set",
        "data.image_size=100000",
    ]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let message = text(&output);
    assert!(
        message.contains("not enough memory")
            && message.contains("2 images of 3 x 100000 x 100000")
            && message.contains("GiB available")
            && message.contains("data.samples_per_gpu")
            && !message.contains("panicked"),
        "{message}"
    );
    assert!(!work_dir.exists(), "nothing written");
}

/// A device whose feature this build lacks is an error naming the flag and the feature to
/// build with, on every command that takes `--device`.
#[test]
fn a_device_not_built_in_is_an_error_naming_its_feature() {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/resnet18_synthetic.toml"
    );
    let mut missing = Vec::new();
    if !cfg!(feature = "wgpu") {
        missing.push(("wgpu", "--features wgpu"));
    }
    if !cfg!(feature = "cuda") {
        missing.push(("cuda", "--features cuda"));
    }
    for (device, feature) in missing {
        for args in [
            vec!["train", config, "--device", device],
            vec!["plan", config, "--budget", "60%", "--device", device],
            vec!["bench", "--iters", "1", "--device", device],
        ] {
            let out = memsave(&args);
            let said = text(&out);
            assert!(!out.status.success(), "{args:?}: {said}");
            assert!(
                said.contains("--device") && said.contains(feature),
                "{args:?}: {said}"
            );
        }
    }
}
