//! `memsave plan` and `with_cp = "auto"` from the command line: bad input is a clear error,
//! a budget the config already meets needs nothing, a budget nothing meets ends training with
//! the advice and leaves the checkpoint that was there as it was.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::memsave;

const TINY: &str = r#"
_base_ = "BASE"
[model.backbone]
base_channels = 8
[data]
type = "SyntheticClassification"
samples_per_gpu = 4
num_samples = 8
image_size = 32
[runner]
type = "EpochBasedRunner"
max_epochs = 2
[log_config]
interval = 1
"#;

fn tiny_config(dir: &Path) -> PathBuf {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/resnet18_synthetic.toml");
    let path = dir.join("tiny.toml");
    std::fs::write(&path, TINY.replace("BASE", base.to_str().unwrap())).unwrap();
    path
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn plan_reports_bad_input_clearly() {
    let dir = common::fresh_dir("plan_cli", "bad");
    let config = tiny_config(&dir);
    let config = config.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["plan", config, "--budget", "abc"],
            "`abc` is not a memory budget",
        ),
        (&["plan", config, "--budget", "150%"], "at most 100%"),
        (
            &[
                "plan",
                config,
                "--budget",
                "1GiB",
                "--set",
                "model.backbone.widht=3",
            ],
            "widht",
        ),
        (
            &["plan", "/no/such/config.toml", "--budget", "1GiB"],
            "/no/such/config.toml",
        ),
    ];
    for (args, expected) in cases {
        let output = memsave(args);
        assert!(!output.status.success(), "{args:?}");
        let text = stderr(&output);
        assert!(text.contains(expected), "{args:?}: {text}");
        assert!(!text.contains("panicked"), "{args:?}: {text}");
    }
}

#[test]
fn plan_says_nothing_is_needed_above_the_unplanned_peak() {
    let dir = common::fresh_dir("plan_cli", "nothing");
    let config = tiny_config(&dir);
    let output = memsave(&[
        "plan",
        config.to_str().unwrap(),
        "--budget",
        "100%",
        "--json",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(report["nothing_needed"], true);
    let peak = report["unplanned"]["peak"].as_u64().unwrap();
    assert!(peak > 0);
    assert_eq!(report["budget_bytes"].as_u64().unwrap(), peak);
    let output = memsave(&["plan", config.to_str().unwrap(), "--budget", "64GiB"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stdout(&output).contains("nothing is needed"),
        "{}",
        stdout(&output)
    );
}

#[test]
fn plan_shows_each_peers_share_under_zero() {
    let dir = common::fresh_dir("plan_cli", "zero");
    let config = tiny_config(&dir);
    let config = config.to_str().unwrap();
    let plan = |stage: &str, devices: &str| {
        let set = format!("optimizer_config.zero_stage={stage}");
        memsave(&[
            "plan",
            config,
            "--budget",
            "100%",
            "--devices",
            devices,
            "--set",
            &set,
            "--json",
        ])
    };
    let output = plan("2", "2");
    assert!(output.status.success(), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let whole = &report["unplanned"];
    let peer = &report["per_peer"];
    let bytes = |v: &serde_json::Value, key: &str| v[key].as_u64().unwrap();
    assert!(
        bytes(whole, "optimizer_state") > 0,
        "SGD with momentum keeps state"
    );
    assert_eq!(
        bytes(peer, "optimizer_state"),
        bytes(whole, "optimizer_state").div_ceil(2)
    );
    assert_eq!(
        bytes(peer, "gradients_at_backward_end"),
        bytes(whole, "gradients_at_backward_end").div_ceil(2)
    );
    assert_eq!(
        bytes(peer, "peak"),
        bytes(whole, "peak")
            - (bytes(whole, "optimizer_state") - bytes(peer, "optimizer_state"))
            - (bytes(whole, "gradients") - bytes(peer, "gradients"))
    );
    // One process: no share to show; a bad stage or no peer is an error naming it.
    let alone = plan("2", "1");
    let report: serde_json::Value = serde_json::from_str(&stdout(&alone)).unwrap();
    assert!(report["per_peer"].is_null());
    for (stage, devices, expected) in [
        ("3", "2", "optimizer_config.zero_stage"),
        ("1", "0", "--devices"),
    ] {
        let output = plan(stage, devices);
        assert!(!output.status.success());
        let text = stderr(&output);
        assert!(text.contains(expected), "{text}");
        assert!(!text.contains("panicked"), "{text}");
    }
}

#[test]
fn plan_with_a_budget_nothing_fits_prints_the_report_and_exits_1() {
    let dir = common::fresh_dir("plan_cli", "unfit");
    let config = tiny_config(&dir);
    let output = memsave(&[
        "plan",
        config.to_str().unwrap(),
        "--budget",
        "1MiB",
        "--json",
    ]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let report: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert!(report["chosen"].is_null());
    assert_eq!(report["nothing_needed"], false);
    let text = stderr(&output);
    assert!(
        text.contains("--budget") && text.contains("nothing memsave can switch on fits 1.0 MiB"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
}

#[test]
fn auto_needs_a_budget_and_a_budget_needs_auto() {
    let dir = common::fresh_dir("plan_cli", "auto_config");
    let config = tiny_config(&dir);
    let config = config.to_str().unwrap();
    let work_dir = dir.join("work");
    let work_dir = work_dir.to_str().unwrap();
    let output = memsave(&[
        "train",
        config,
        "--work-dir",
        work_dir,
        "--set",
        "model.backbone.with_cp=\"auto\"",
    ]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("memory_budget"),
        "{}",
        stderr(&output)
    );
    let output = memsave(&[
        "train",
        config,
        "--work-dir",
        work_dir,
        "--set",
        "memory.memory_budget=\"1GiB\"",
    ]);
    assert!(!output.status.success());
    assert!(stderr(&output).contains("\"auto\""), "{}", stderr(&output));
    let output = memsave(&[
        "train",
        config,
        "--work-dir",
        work_dir,
        "--set",
        "model.backbone.with_cp=\"sometimes\"",
    ]);
    assert!(!output.status.success());
    assert!(stderr(&output).contains("sometimes"), "{}", stderr(&output));
    // A pinned plan naming no segment.
    let output = memsave(&[
        "train",
        config,
        "--work-dir",
        work_dir,
        "--set",
        "model.backbone.with_cp=[\"backbone.layer9.0\"]",
    ]);
    assert!(!output.status.success());
    let text = stderr(&output);
    assert!(
        text.contains("backbone.layer9.0") && text.contains("backbone.layer1.0"),
        "{text}"
    );
}

#[test]
fn auto_trains_within_a_budget_and_a_pinned_plan_trains() {
    let dir = common::fresh_dir("plan_cli", "auto_train");
    let config = tiny_config(&dir);
    let work_dir = dir.join("work");
    let output = memsave(&[
        "train",
        config.to_str().unwrap(),
        "--work-dir",
        work_dir.to_str().unwrap(),
        "--set",
        "model.backbone.with_cp=\"auto\"",
        "--set",
        "memory.memory_budget=\"100%\"",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stderr(&output);
    assert!(text.contains("plan: checkpoint"), "{text}");
    // The checks of the following steps, in the log too.
    let log = std::fs::read_to_string(work_dir.join("train.log")).unwrap();
    assert!(log.contains("plan: step 2: budget="), "{log}");
    let output = memsave(&[
        "train",
        config.to_str().unwrap(),
        "--work-dir",
        dir.join("pinned").to_str().unwrap(),
        "--set",
        "model.backbone.with_cp=[\"backbone.layer1.0\", \"backbone.layer2.1\"]",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
}

#[test]
fn an_unmeetable_budget_ends_with_advice_and_keeps_the_checkpoint() {
    let dir = common::fresh_dir("plan_cli", "unmeetable");
    let config = tiny_config(&dir);
    let work_dir = dir.join("work");
    std::fs::create_dir_all(&work_dir).unwrap();
    let kept = b"the last checkpoint of an earlier run";
    std::fs::write(work_dir.join("latest.ckpt"), kept).unwrap();
    let output = memsave(&[
        "train",
        config.to_str().unwrap(),
        "--work-dir",
        work_dir.to_str().unwrap(),
        "--set",
        "model.backbone.with_cp=\"auto\"",
        "--set",
        "memory.memory_budget=\"1MiB\"",
    ]);
    assert!(!output.status.success());
    let text = stderr(&output);
    assert!(
        text.contains("every one of the 8 segments checkpointed"),
        "{text}"
    );
    assert!(text.contains("what would fit 1.0 MiB"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    assert_eq!(std::fs::read(work_dir.join("latest.ckpt")).unwrap(), kept);
    let written: Vec<_> = std::fs::read_dir(&work_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "ckpt"))
        .collect();
    assert_eq!(written.len(), 1, "{written:?}");
}
