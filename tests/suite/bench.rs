//! `memsave bench`: the eight configurations on a small RetinaNet (ResNet-18, 64 x 64 images),
//! each in its own process; the report's schema, its breakdown adding up and measuring what it
//! says (Adam's state is twice SGD's), the pictures, `--compare`, and bad input.

use crate::common;

use std::path::Path;

use common::{fresh_dir, memsave};
use serde_json::Value;

/// A small, quick bench: ResNet-18 at 64 x 64, narrow stages.
fn small(out: &Path, extra: &[&str]) -> std::process::Output {
    let out = out.to_str().unwrap();
    let mut args = vec![
        "bench",
        "--depth",
        "18",
        "--image-size",
        "64",
        "--iters",
        "2",
        "--out",
        out,
        "--set",
        "model.backbone.base_channels=16",
    ];
    args.extend_from_slice(extra);
    memsave(&args)
}

fn text(output: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn bytes(config: &Value, key: &str) -> u64 {
    config["breakdown"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("{} has no breakdown.{key}", config["name"]))
}

fn is_png(path: &Path) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        data.len() > 10_000,
        "{}: {} bytes",
        path.display(),
        data.len()
    );
    assert_eq!(&data[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
}

#[test]
fn every_configuration_measured_reported_and_drawn() {
    let out = fresh_dir("bench", "five");
    let output = small(&out, &[]);
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");

    let report = read(&out.join("bench.json"));
    assert_eq!(report["image_size"], serde_json::json!([64, 64]));
    assert_eq!(report["batch"], 2);
    assert_eq!(report["iters"], 2);
    assert!(report["device"].as_str().unwrap().contains("CPU"));
    let configs = report["configs"].as_array().unwrap();
    let names: Vec<&str> = configs
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "base",
            "amp",
            "accumulation",
            "checkpoint",
            "all",
            "step_in_backward",
            "int8_state",
            "lean",
            "bf16_weights",
            "lean_bf16"
        ]
    );
    for config in configs {
        let name = &config["name"];
        let peak = config["peak_bytes"].as_u64().unwrap();
        assert!(peak > 1 << 20, "{name}: peak {peak}");
        let time = config["median_iter_s"].as_f64().unwrap();
        assert!(time > 0.0 && time < 300.0, "{name}: {time} s");
        assert_eq!(config["iter_s"].as_array().unwrap().len(), 2, "{name}");
        assert!(config["final_loss"].as_f64().unwrap().is_finite(), "{name}");
        // The parts add up to the live bytes at the peak, which are the baseline plus the peak.
        let total = bytes(config, "total");
        assert_eq!(total, bytes(config, "baseline") + peak, "{name}");
        assert_eq!(
            config["whole_step_peak_bytes"].as_u64(),
            Some(total),
            "{name}"
        );
        let parts: u64 = [
            "parameters",
            "optimizer_state",
            "activations",
            "gradients",
            "optimizer_step",
            "other",
        ]
        .iter()
        .map(|key| bytes(config, key))
        .sum();
        assert!(
            parts >= total && parts <= total + total / 50,
            "{name}: {parts} vs {total}"
        );
        if !name.as_str().unwrap().contains("step_in_backward") {
            assert!(bytes(config, "gradients") > 0, "{name}");
        }
        // A timeline of the last step, phases named.
        let timeline = config["timeline"].as_array().unwrap();
        assert!(timeline.len() > 10, "{name}: {} samples", timeline.len());
        let phases: Vec<&str> = config["timeline_phase"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert!(
            phases.contains(&"forward") && phases.contains(&"backward"),
            "{name}"
        );
    }
    let config = |name: &str| configs.iter().find(|c| c["name"] == name).unwrap();
    // The same weights everywhere; the half copy on top under mixed precision.
    let weights = bytes(config("base"), "parameters");
    for name in ["checkpoint", "accumulation"] {
        let other = bytes(config(name), "parameters");
        assert!(
            other.abs_diff(weights) < weights / 1000,
            "{name}: {other} vs {weights}"
        );
    }
    let half = bytes(config("amp"), "parameters") - weights;
    assert!(
        half > weights / 4 && half < weights * 3 / 4,
        "{half} vs {weights}"
    );
    // Checkpointing recomputes in backward (memsave's counter over the measured steps, not the
    // sampled timeline, which a short recomputation can fall between samples of); accumulation
    // runs two micro-batches.
    let recomputations = |name: &str| config(name)["recomputations"].as_u64().unwrap();
    assert!(recomputations("checkpoint") > 0);
    assert_eq!(recomputations("base"), 0);
    // Accumulation trains on the same images, so its losses are those of base's halves.
    let loss = |name: &str| config(name)["final_loss"].as_f64().unwrap();
    assert!((loss("accumulation") - loss("base")).abs() < 0.5);
    assert!((loss("checkpoint") - loss("base")).abs() < 1e-3);
    // The step in backward is the same training (two passes: the config clips); its peak
    // holds next to no gradient.
    assert_eq!(loss("step_in_backward"), loss("base"));
    let gradients = |name: &str| bytes(config(name), "gradients");
    assert!(
        gradients("step_in_backward") * 3 < gradients("base"),
        "{} vs {}",
        gradients("step_in_backward"),
        gradients("base")
    );
    // 8-bit state: about a quarter of the momentum's bytes.
    let state = |name: &str| bytes(config(name), "optimizer_state");
    assert!(
        state("int8_state") * 10 < state("base") * 4,
        "{} vs {}",
        state("int8_state"),
        state("base")
    );
    // `lean` holds less over the whole step than `base`.
    let whole = |name: &str| config(name)["whole_step_peak_bytes"].as_u64().unwrap();
    assert!(
        whole("lean") < whole("base"),
        "{} vs {}",
        whole("lean"),
        whole("base")
    );
    // bf16 weights: half the parameters' bytes (BatchNorm's stay fp32: a little more), and
    // less again with lean.
    let bf16 = bytes(config("bf16_weights"), "parameters");
    assert!(
        bf16 * 2 >= weights && bf16 * 2 < weights + weights / 20,
        "{bf16} vs {weights}"
    );
    assert!(
        whole("lean_bf16") < whole("lean"),
        "{} vs {}",
        whole("lean_bf16"),
        whole("lean")
    );
    assert!(loss("bf16_weights").is_finite());

    // The table on stdout, the pictures on disk.
    assert!(
        stdout.contains("| config | peak MiB | memory vs base |"),
        "{stdout}"
    );
    for name in names {
        assert!(stdout.contains(&format!("| {name} |")), "{stdout}");
    }
    is_png(&out.join("bench_bars.png"));
    is_png(&out.join("bench_timeline.png"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn adam_state_is_measured_twice_sgd_and_a_comparison_sits_beside() {
    let out = fresh_dir("bench", "adam");
    let sgd_out = out.join("sgd");
    let output = small(&sgd_out, &["--only", "base"]);
    assert!(output.status.success(), "{:?}", text(&output));
    let sgd = read(&sgd_out.join("bench.json"));

    // The SGD run, relabelled, as another tool's report to compare with.
    let mut other = sgd.clone();
    other["framework"] = "Other 1.0".into();
    let compare = out.join("other.json");
    std::fs::write(&compare, other.to_string()).unwrap();
    let adam_out = out.join("adam");
    let output = small(
        &adam_out,
        &[
            "--only",
            "base",
            "--optimizer",
            "adam",
            "--compare",
            compare.to_str().unwrap(),
        ],
    );
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let adam = read(&adam_out.join("bench.json"));
    assert_eq!(adam["optimizer"], "Adam");
    let state = |report: &Value| bytes(&report["configs"][0], "optimizer_state") as f64;
    let ratio = state(&adam) / state(&sgd);
    assert!((1.8..2.2).contains(&ratio), "Adam's state / SGD's: {ratio}");
    // SGD's momentum is one copy of the trainable weights: less than all the weights, plus
    // what the first step leaves on every thread that ran a matrix product (gemm's scratch,
    // the size of the L2 cache each: 2 MiB on a 2-core machine's main and two pool threads).
    let weights = bytes(&sgd["configs"][0], "parameters") as f64;
    let scratch = 8.0 * 1024.0 * 1024.0;
    assert!(
        state(&sgd) > 0.3 * weights && state(&sgd) < 1.05 * weights + scratch,
        "SGD's state {} against weights {weights}",
        state(&sgd)
    );
    assert!(stdout.contains("beside Other 1.0"), "{stdout}");
    assert!(stdout.contains("| base |"), "{stdout}");
    is_png(&adam_out.join("bench_bars.png"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_input_is_a_clear_error() {
    let out = fresh_dir("bench", "bad");
    let dir = out.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--only", "fast"], "`fast` is not a configuration"),
        (vec!["--batch", "3"], "--batch"),
        (vec!["--iters", "0"], "--iters"),
        (
            vec!["--compare", "/nonexistent/torch.json"],
            "/nonexistent/torch.json",
        ),
        (
            vec!["--config", "/nonexistent/c.toml"],
            "/nonexistent/c.toml",
        ),
        (
            vec![
                "--config",
                "configs/resnet18_synthetic.toml",
                "--only",
                "base",
            ],
            "RetinaNet",
        ),
        (
            vec!["--only", "base", "--set", "model.backbone.depht=18"],
            "model.backbone.depht",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["bench", "--out", dir, "--image-size", "64", "--depth", "18"];
        args.extend(extra.iter().copied());
        let output = memsave(&args);
        let (_, stderr) = text(&output);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // A bad image size is refused by the argument parser.
    let output = memsave(&["bench", "--out", dir, "--image-size", "abc"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("`abc`"));
    // Without CUDA, `--device cuda` says so.
    #[cfg(not(feature = "cuda"))]
    {
        let output = memsave(&["bench", "--out", dir, "--device", "cuda"]);
        let (_, stderr) = text(&output);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("CUDA"), "{stderr}");
    }
    // A damaged comparison file names itself.
    let damaged = out.join("damaged.json");
    std::fs::write(&damaged, "{\"device\": 3").unwrap();
    let output = memsave(&[
        "bench",
        "--out",
        dir,
        "--compare",
        damaged.to_str().unwrap(),
    ]);
    let (_, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("damaged.json") && stderr.contains("not a bench.json"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
