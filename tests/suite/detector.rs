//! RetinaNet from the command line: the configs, `memsave data synth-voc` and `voc-map`, a
//! short training with each strategy (and the evaluation hook), and `memsave test` on its
//! checkpoint.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use memsave::config::Config;
use memsave::models::config::{DetectionDataSection, RetinaNetSection};

use common::memsave;

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("det", name)
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The command failed, without a panic, with `words` in its message.
fn fails_with(out: &Output, words: &str) {
    let log = text(out);
    assert!(!out.status.success(), "succeeded: {log}");
    assert!(log.contains(words), "no `{words}` in: {log}");
    assert!(!log.contains("panicked"), "{log}");
}

fn configs() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs")
}

#[test]
fn every_retinanet_config_reads_and_fits_together() {
    for base in ["retinanet_r50_fpn_voc", "retinanet_r18_fpn_synthvoc"] {
        for suffix in ["", "_fp16", "_accumulation", "_checkpointing"] {
            let path = configs().join(format!("{base}{suffix}.toml"));
            let config = Config::<RetinaNetSection, DetectionDataSection>::load(&path, &[])
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let detector = config.model.retinanet().unwrap();
            assert_eq!(detector.bbox_head.num_classes, 20);
            assert_eq!(
                config.model.backbone.with_cp.starts_on(),
                suffix == "_checkpointing"
            );
            assert_eq!(config.fp16.is_some(), suffix == "_fp16");
            assert!(config.evaluation.is_some());
        }
    }
    let r50 = Config::<RetinaNetSection, DetectionDataSection>::load(
        &configs().join("retinanet_r50_fpn_voc.toml"),
        &[],
    )
    .unwrap();
    assert_eq!(r50.data.samples_per_gpu, 2);
    assert_eq!(
        (
            r50.model.backbone.frozen_stages,
            r50.model.backbone.norm_eval
        ),
        (1, true)
    );
    // A mismatch between the pieces is an error naming the field.
    let error = Config::<RetinaNetSection, DetectionDataSection>::load(
        &configs().join("retinanet_r50_fpn_voc.toml"),
        &["model.neck.in_channels=[64, 128, 256, 512]".to_string()],
    )
    .unwrap()
    .model
    .retinanet()
    .unwrap_err()
    .to_string();
    assert!(error.contains("model.neck.in_channels"), "{error}");
}

/// The small config on a synthetic set of `images` in `dir`, narrower still (test speed).
fn tiny(dir: &Path, images: usize) -> PathBuf {
    let out = memsave(&[
        "data",
        "synth-voc",
        dir.to_str().unwrap(),
        "--images",
        &images.to_string(),
        "--seed",
        "3",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let root = dir.join("VOC2007");
    let config = format!(
        r#"
_base_ = "{base}"
[model.backbone]
base_channels = 8
[model.neck]
in_channels = [8, 16, 32, 64]
out_channels = 32
[model.bbox_head]
in_channels = 32
feat_channels = 32
[data]
samples_per_gpu = 2
[data.train]
ann_file = "{root}/ImageSets/Main/trainval.txt"
img_prefix = "{root}/"
[data.test]
ann_file = "{root}/ImageSets/Main/test.txt"
img_prefix = "{root}/"
[runner]
type = "EpochBasedRunner"
max_epochs = 2
[evaluation]
interval = 2
[log_config]
interval = 1
"#,
        base = configs().join("retinanet_r18_fpn_synthvoc.toml").display(),
        root = root.display()
    );
    let path = dir.join("tiny.toml");
    std::fs::write(&path, config).unwrap();
    path
}

#[test]
fn ground_truth_as_detections_scores_one_and_bad_files_are_errors() {
    let dir = dir("map");
    let out = memsave(&["data", "synth-voc", dir.to_str().unwrap(), "--images", "8"]);
    assert!(out.status.success(), "{}", text(&out));
    let root = dir.join("VOC2007");
    let images =
        memsave::models::data::voc::read_split(&root.join("ImageSets/Main/test.txt"), &root)
            .unwrap();
    let records: Vec<serde_json::Value> = images
        .iter()
        .flat_map(|image| {
            image.objects.iter().map(|o| {
                serde_json::json!({
                    "image": image.id,
                    "class": memsave::models::data::voc::VOC_CLASSES[o.label],
                    "score": 0.9,
                    "box": o.bbox,
                })
            })
        })
        .collect();
    let dets = dir.join("dets.json");
    std::fs::write(&dets, serde_json::to_string(&records).unwrap()).unwrap();
    let voc_map = |split: &str, extra: &[&str]| {
        let mut args = vec!["data", "voc-map", dir.to_str().unwrap(), "--split", split];
        args.extend(["--detections", dets.to_str().unwrap()]);
        args.extend(extra);
        memsave(&args)
    };
    for metric in ["11points", "area"] {
        let out = voc_map("test", &["--metric", metric]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", text(&out));
        assert_eq!(stdout.lines().last(), Some("mAP: 1.0000"), "{stdout}");
        assert_eq!(stdout.lines().count(), 22, "a header, 20 classes, the mAP");
    }
    std::fs::write(
        &dets,
        "[{\"image\": \"000004\", \"class\": \"dragon\", \"score\": 1, \"box\": [1, 1, 2, 2]}]",
    )
    .unwrap();
    let out = voc_map("test", &[]);
    fails_with(&out, "dragon");
    assert!(text(&out).contains("dets.json"), "{}", text(&out));
    fails_with(&voc_map("val", &[]), "val.txt");
    let out = memsave(&["data", "synth-voc", dir.to_str().unwrap()]);
    fails_with(&out, "already exists");
}

#[test]
fn trains_with_each_strategy_evaluates_and_tests_its_checkpoint() {
    let dir = dir("train");
    let config = tiny(&dir, 12);
    for (name, set) in common::strategy_overrides("512.0") {
        let work = dir.join(name);
        let mut args = vec![
            "train",
            config.to_str().unwrap(),
            "--work-dir",
            work.to_str().unwrap(),
        ];
        args.extend(set.iter().map(String::as_str));
        let out = memsave(&args);
        let log = text(&out);
        assert!(out.status.success(), "{name}: {log}");
        assert!(
            log.contains("evaluation at epoch 2 (3 images)"),
            "{name}: {log}"
        );
        assert!(log.contains("mAP: "), "{name}: {log}");
        let written = std::fs::read_to_string(work.join("train.log")).unwrap();
        // MMDetection's log: the loss's parts beside it, adding up to it.
        let line = written
            .lines()
            .rfind(|l| l.starts_with("Epoch [2]"))
            .unwrap();
        let value = |key: &str| -> f64 {
            let rest = &line[line
                .find(&format!("  {key}: "))
                .unwrap_or_else(|| panic!("{name}: no {key} in {line}"))
                + key.len()
                + 4..];
            rest.split_whitespace().next().unwrap().parse().unwrap()
        };
        let (cls, bbox, loss) = (value("loss_cls"), value("loss_bbox"), value("loss"));
        assert!((cls + bbox - loss).abs() <= 2e-4, "{name}: {line}");
        assert!(
            written.contains("mAP: "),
            "{name}: the evaluation is in train.log"
        );
    }
    let work = dir.join("plain");
    let checkpoint = work.join("latest.ckpt");
    let dets = dir.join("dets.json");
    let out = memsave(&[
        "test",
        config.to_str().unwrap(),
        checkpoint.to_str().unwrap(),
        "--out",
        dets.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().last().unwrap().starts_with("mAP: "),
        "{stdout}"
    );
    // The file it wrote scores the same through `voc-map`.
    let out2 = memsave(&[
        "data",
        "voc-map",
        dir.join("VOC2007").to_str().unwrap(),
        "--split",
        "test",
        "--detections",
        dets.to_str().unwrap(),
    ]);
    assert!(out2.status.success(), "{}", text(&out2));
    assert_eq!(
        stdout.lines().last(),
        String::from_utf8_lossy(&out2.stdout).lines().last()
    );
    // A checkpoint of another model is an error naming it.
    let out = memsave(&[
        "test",
        config.to_str().unwrap(),
        checkpoint.to_str().unwrap(),
        "--set",
        "model.bbox_head.feat_channels=16",
    ]);
    fails_with(&out, "latest.ckpt");
    // So is a classifier config.
    let classifier = configs().join("resnet18_synthetic.toml");
    let out = memsave(&[
        "test",
        classifier.to_str().unwrap(),
        checkpoint.to_str().unwrap(),
    ]);
    fails_with(&out, "model.type");
}

#[test]
fn bad_detector_settings_are_errors_naming_the_field() {
    let dir = dir("bad");
    let config = tiny(&dir, 8);
    for (sets, field) in [
        (
            &["model.bbox_head.num_classes=4"][..],
            "model.bbox_head.num_classes",
        ),
        (
            &["model.train_cfg.assigner.pos_iou_thr=1.5"],
            "model.train_cfg.assigner.pos_iou_thr",
        ),
        (
            &["model.neck.add_extra_convs=\"on_nothing\""],
            "model.neck.add_extra_convs",
        ),
        (&["evaluation.metric=\"bbox\""], "evaluation.metric"),
        (&["data.samples_per_gpu=0"], "data.samples_per_gpu"),
        (
            &["data.train.ann_file=\"/nonexistent/trainval.txt\""],
            "/nonexistent/trainval.txt",
        ),
        // The planner picks the neck's and head's segments under "auto": their own key beside
        // it would be ignored, so it is an error naming it (and the planner).
        (
            &[
                "model.backbone.with_cp=\"auto\"",
                "memory.memory_budget=\"80%\"",
                "model.bbox_head.with_cp=true",
            ],
            "model.bbox_head.with_cp",
        ),
    ] {
        let work = dir.join("w");
        let mut args = vec![
            "train",
            config.to_str().unwrap(),
            "--work-dir",
            work.to_str().unwrap(),
        ];
        for set in sets {
            args.extend(["--set", set]);
        }
        let out = memsave(&args);
        let log = text(&out);
        assert!(!out.status.success(), "{sets:?}: {log}");
        assert!(log.contains(field), "{sets:?}: {log}");
        assert!(!log.contains("panicked"), "{sets:?}: {log}");
    }
}

#[test]
fn trains_on_two_peers_with_every_strategy_at_once_and_rank_0_alone_logs_and_evaluates() {
    let dir = dir("two-peers");
    let config = tiny(&dir, 12);
    let work = dir.join("all");
    let mut args = vec![
        "train",
        config.to_str().unwrap(),
        "--work-dir",
        work.to_str().unwrap(),
        "--devices",
        "2",
    ];
    // Mixed precision, accumulation and checkpointing together, on each peer.
    let all: Vec<String> = common::strategy_overrides("\"dynamic\"")
        .into_iter()
        .flat_map(|(_, set)| set)
        .collect();
    args.extend(all.iter().map(String::as_str));
    let out = memsave(&args);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("data parallel: 2 peers"), "{log}");
    assert_eq!(
        log.matches("evaluation at epoch 2 (3 images)").count(),
        1,
        "rank 0 alone evaluates: {log}"
    );
    let written = std::fs::read_to_string(work.join("train.log")).unwrap();
    let lines: Vec<&str> = written.lines().filter(|l| l.starts_with("Epoch")).collect();
    // 9 training images: 5 per peer (one repeated), 3 batches of 2 an epoch, logged once each.
    assert_eq!(lines.len(), 6, "{written}");
    assert!(lines.iter().all(|l| l.contains("loss_scale")), "{written}");
    assert!(work.join("latest.ckpt").exists());
}
