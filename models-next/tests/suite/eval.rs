//! Evaluation during training on Burn 0.22: the synthetic VOC config (the file memsave on Burn 0.21
//! reads) trains RetinaNet in memsave-next's runner with the evaluation hook, whose mAP in
//! `train.log` is the trained detector's on the test split; the classifier's accuracy hook by
//! epoch and by iteration; the scores the same whichever device the evaluation data was made for.

use crate::common;

use common::watchdog;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use memsave_models_next::classifier::ImageClassifier;
use memsave_models_next::config::{
    ClassifierSection, DataSection, DetectionDataSection, RetinaNetSection,
};
use memsave_models_next::data::synthetic::SyntheticClassification;
use memsave_models_next::data::voc::loader::VocDetection;
use memsave_models_next::data::voc::synth::write_synthetic_voc;
use memsave_models_next::eval::accuracy::{accuracy, AccuracyHook};
use memsave_models_next::eval::hook::{detect, evaluate, EvalHook};
use memsave_models_next::eval::voc::ApMode;
use memsave_next::config::{Config, ConfigHooks};
use memsave_next::train::Runner;

pub fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

pub fn work_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "memsave-models-next-eval-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The `--set` lines that put `configs/retinanet_r18_fpn_synthvoc.toml` on a synthetic set in
/// `root`, narrowed (test speed), trained two epochs with an evaluation after each.
pub fn synthvoc_sets(root: &Path) -> Vec<String> {
    let root = root.display();
    [
        "model.backbone.base_channels=8".to_string(),
        "model.neck.in_channels=[8, 16, 32, 64]".into(),
        "model.neck.out_channels=32".into(),
        "model.bbox_head.in_channels=32".into(),
        "model.bbox_head.feat_channels=32".into(),
        "data.samples_per_gpu=2".into(),
        format!("data.train.ann_file=\"{root}/ImageSets/Main/trainval.txt\""),
        format!("data.train.img_prefix=\"{root}/\""),
        format!("data.test.ann_file=\"{root}/ImageSets/Main/test.txt\""),
        format!("data.test.img_prefix=\"{root}/\""),
        // Two epochs leave every score below the config's 0.05: keep the best 20 of any score, so
        // that the evaluations compare detections.
        "model.test_cfg.score_thr=0.0".into(),
        "model.test_cfg.max_per_img=20".into(),
        "runner.max_epochs=2".into(),
        "lr_config.warmup_iters=2".into(),
        "evaluation.interval=1".into(),
        "log_config.interval=1".into(),
    ]
    .into()
}

/// `configs/retinanet_r18_fpn_synthvoc.toml` with [`synthvoc_sets`].
fn synthvoc_config(root: &Path) -> Config<RetinaNetSection, DetectionDataSection> {
    Config::load(
        &configs().join("retinanet_r18_fpn_synthvoc.toml"),
        &synthvoc_sets(root),
    )
    .unwrap()
}

#[test]
fn the_synthvoc_config_trains_retinanet_and_the_eval_hook_logs_its_map() {
    watchdog(600, || {
        let data_dir = tempfile::tempdir().unwrap();
        let root = write_synthetic_voc(data_dir.path(), 8, 3).unwrap();
        let config = synthvoc_config(&root);
        let detector = config.model.retinanet().unwrap();
        let device = Device::flex().autodiff();
        device.seed(config.seed);
        let model = detector.init(&device).unwrap();
        let section = &config.data;
        let train = VocDetection::new(
            &section.train,
            "data.train",
            true,
            section.samples_per_gpu,
            section.workers_per_gpu,
            config.seed,
            device.clone(),
        )
        .unwrap();
        // Made for the training device (autodiff): the hook evaluates without it.
        let test = |device: Device| {
            VocDetection::new(
                &section.test,
                "data.test",
                false,
                section.samples_per_gpu,
                section.workers_per_gpu,
                0,
                device,
            )
            .unwrap()
        };
        let images = test(Device::flex()).images().len();
        assert_eq!(images, 2, "every fourth of 8 images is a test image");
        let mode = if section.test.is_voc2007() {
            ApMode::ElevenPoints
        } else {
            ApMode::Area
        };
        assert_eq!(mode, ApMode::ElevenPoints, "the set is written as VOC2007");
        let evaluation = config.evaluation.as_ref().unwrap();
        let dir = work_dir("retinanet");
        let mut runner = Runner::new(
            model,
            config.build_optimizer().unwrap(),
            config.optimizer_hook().unwrap(),
            train,
            config.run_length().unwrap(),
            &dir,
            device.clone(),
        )
        .unwrap();
        for hook in config.hooks().unwrap() {
            runner.register_hook(hook);
        }
        runner.register_hook(Box::new(
            EvalHook::new(
                test(device.clone()),
                evaluation.interval,
                config.runner.by_epoch(),
                mode,
            )
            .unwrap(),
        ));
        runner.run().unwrap();
        let log = std::fs::read_to_string(dir.join("train.log")).unwrap();
        assert_eq!(
            log.matches(&format!(" ({images} images):\n")).count(),
            2,
            "an evaluation after each of the 2 epochs: {log}"
        );
        // The last evaluation is the trained detector's, on the test split.
        let model = runner.into_model();
        let (records, result) = evaluate(&model, &test(Device::flex()), mode).unwrap();
        let table = format!("evaluation at epoch 2 ({images} images):\n{result}");
        println!("{table}");
        assert!(log.contains(&table), "{table}\nnot in\n{log}");
        assert_eq!(result.classes.len(), 20, "VOC's classes");
        assert_eq!(records.len(), 2 * 20, "20 detections an image");
        assert!((0.0..=1.0).contains(&result.map), "{}", result.map);
        // The evaluation data's device does not change a score: the same detections from data
        // made for the autodiff device.
        let from_autodiff = detect(&model, &test(device)).unwrap();
        assert_eq!(from_autodiff.len(), records.len());
        for (a, b) in from_autodiff.iter().zip(&records) {
            assert_eq!(
                (&a.image, &a.class, a.score.to_bits(), a.bbox),
                (&b.image, &b.class, b.score.to_bits(), b.bbox)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn the_accuracy_hook_scores_the_classifier_by_epoch_and_by_iteration() {
    watchdog(300, || {
        let sets: Vec<String> = [
            "model.backbone.base_channels=8",
            "data.samples_per_gpu=4",
            "data.num_samples=24",
            "data.image_size=32",
            "runner.max_epochs=2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let config = Config::<ClassifierSection, DataSection>::load(
            &configs().join("resnet18_synthetic.toml"),
            &sets,
        )
        .unwrap();
        let num_classes = config.model.classes().unwrap();
        let DataSection::SyntheticClassification(section) = &config.data;
        let device = Device::flex().autodiff();
        device.seed(config.seed);
        let model = ImageClassifier::new(&config.model.backbone, num_classes, &device).unwrap();
        let mut held_out = section.clone();
        held_out.seed ^= 0x5EED;
        held_out.num_samples = 12;
        held_out.samples_per_gpu = 4;
        held_out.shuffle = false;
        let held_out =
            |device: Device| SyntheticClassification::new(held_out.clone(), num_classes, device);
        let train =
            SyntheticClassification::new(section.clone(), num_classes, device.clone()).unwrap();
        let iters = config.run_length().unwrap();
        let dir = work_dir("classifier");
        let mut runner = Runner::new(
            model,
            config.build_optimizer().unwrap(),
            config.optimizer_hook().unwrap(),
            train,
            iters,
            &dir,
            device.clone(),
        )
        .unwrap();
        for hook in config.hooks().unwrap() {
            runner.register_hook(hook);
        }
        // Each epoch, and every 4 iterations, on data made for the autodiff device.
        runner.register_hook(Box::new(
            AccuracyHook::new(held_out(device.clone()).unwrap(), 1, true).unwrap(),
        ));
        runner.register_hook(Box::new(
            AccuracyHook::new(held_out(device.clone()).unwrap(), 4, false).unwrap(),
        ));
        runner.run().unwrap();
        let log = std::fs::read_to_string(dir.join("train.log")).unwrap();
        let lines = |unit: &str| -> Vec<String> {
            log.lines()
                .filter(|l| l.starts_with(&format!("{unit}(val) [")))
                .map(String::from)
                .collect()
        };
        let (epochs, iters) = (lines("Epoch"), lines("Iter"));
        // 24 samples in batches of 4 (the config's samples_per_gpu): 6 iterations an epoch.
        assert_eq!(epochs.len(), 2, "{log}");
        assert_eq!(iters.len(), 3, "at iterations 4, 8 and 12: {log}");
        assert!(iters[2].starts_with("Iter(val) [12]"), "{}", iters[2]);
        let model = runner.into_model();
        let result = accuracy(&model, &held_out(Device::flex()).unwrap()).unwrap();
        let expected = format!(
            "Epoch(val) [2]  accuracy_top-1: {:.2}  loss: {:.4}  (12 held-out samples)",
            100.0 * result.top1,
            result.loss
        );
        assert_eq!(epochs[1], expected);
        assert!(result.loss.is_finite() && (0.0..=1.0).contains(&result.top1));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn an_evaluation_every_zero_epochs_is_an_error_naming_the_key() {
    let _turn = common::one_at_a_time();
    let data_dir = tempfile::tempdir().unwrap();
    let root = write_synthetic_voc(data_dir.path(), 4, 1).unwrap();
    let config = synthvoc_config(&root);
    let data = VocDetection::new(
        &config.data.test,
        "data.test",
        false,
        1,
        0,
        0,
        Device::flex(),
    )
    .unwrap();
    let error = EvalHook::new(data, 0, true, ApMode::Area)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("evaluation.interval"), "{error}");
    let held_out = SyntheticClassification::new(
        memsave_models_next::data::synthetic::SyntheticClassificationConfig::new(2, 4, 16),
        2,
        Device::flex(),
    )
    .unwrap();
    let error = AccuracyHook::new(held_out, 0, false)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("evaluation.interval"), "{error}");
}
