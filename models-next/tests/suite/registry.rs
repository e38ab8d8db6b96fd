//! The registry on Burn 0.22: each model's config (the files memsave on Burn 0.21 reads) builds
//! its model, data and own hooks, seeded, and a job trains them in memsave-next's runner; what
//! a measuring job or a later peer builds; the keys and errors a command speaks.

use crate::common;

use common::watchdog;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use memsave_models_next::registry::{
    batch_size, build, entry, multiscale_training, Built, ModelJob, Purpose, Setup, BACKBONE_KEYS,
    DETECTOR_KEYS,
};
use memsave_next::checkpoint::CheckpointModule;
use memsave_next::config::{Config, ConfigHooks};
use memsave_next::parallel::Shard;
use memsave_next::planner::{ModelKeys, WithCp};
use memsave_next::train::{DataSource, Runner, TrainModel};

use super::eval::{configs, synthvoc_sets, work_dir};

/// What a job saw of the model it was handed.
#[derive(Debug)]
struct Report {
    batch: usize,
    hooks: usize,
    with_cp: WithCp,
    keys: ModelKeys,
    batches_per_epoch: usize,
    weights: Vec<u32>,
    /// `train.log`, when the job trained.
    log: Option<String>,
}

/// The bits of every float parameter, in visiting order.
fn weights<M: Module>(model: &M) -> Vec<u32> {
    struct Bits(Vec<u32>);
    impl ModuleVisitor for Bits {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0
                .extend(param.val().into_data().iter::<f32>().map(f32::to_bits));
        }
    }
    let mut bits = Bits(Vec::new());
    model.valid().visit(&mut bits);
    bits.0
}

/// The float parameters of `model`, and those not initialized yet.
fn lazy_params<M: Module>(model: &M) -> (usize, usize) {
    struct Lazy(usize, usize);
    impl ModuleVisitor for Lazy {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 += 1;
            self.1 += !param.is_initialized() as usize;
        }
    }
    let mut lazy = Lazy(0, 0);
    model.visit(&mut lazy);
    (lazy.0, lazy.1)
}

/// Reports what it was handed; trains it in `work` with the config's optimizer and hooks and the
/// model's own when `work` is given.
struct Job {
    work: Option<std::path::PathBuf>,
    device: Device,
}

impl ModelJob for Job {
    type Output = Report;

    fn run<S, D, M, Data>(
        self,
        config: &Config<S, D>,
        built: Built<M, Data>,
    ) -> memsave_next::Result<Report>
    where
        M: TrainModel + CheckpointModule,
        Data: DataSource<M::Batch> + 'static,
    {
        // `build` drew every parameter (Burn 0.22's are lazy): none is left for a later draw.
        let (params, lazy) = lazy_params(&built.model);
        assert!(
            params > 0 && lazy == 0,
            "{lazy} of {params} parameters lazy"
        );
        let mut report = Report {
            batch: built.batch,
            hooks: built.hooks.len(),
            with_cp: built.with_cp.clone(),
            keys: built.keys,
            batches_per_epoch: built.data.batches_per_epoch(),
            weights: weights(&built.model),
            log: None,
        };
        let Some(work) = self.work else {
            return Ok(report);
        };
        let mut runner = Runner::new(
            built.model,
            config.build_optimizer()?,
            config.optimizer_hook()?,
            built.data,
            config.run_length()?,
            &work,
            self.device,
        )?;
        for hook in config.hooks()? {
            runner.register_hook(hook);
        }
        for hook in built.hooks {
            runner.register_hook(hook);
        }
        runner.run()?;
        report.log = Some(std::fs::read_to_string(work.join("train.log")).unwrap());
        let _ = std::fs::remove_dir_all(&work);
        Ok(report)
    }
}

fn run(
    file: &str,
    sets: &[String],
    purpose: Purpose,
    shard: Shard,
    work: Option<&str>,
) -> memsave_next::Result<Report> {
    let device = Device::flex().autodiff();
    let setup = Setup {
        config: &configs().join(file),
        sets,
        purpose,
        device: device.clone(),
        shard,
    };
    build(
        setup,
        Job {
            work: work.map(work_dir),
            device,
        },
    )
}

fn classifier_sets(extra: &[&str]) -> Vec<String> {
    [
        "model.backbone.base_channels=8",
        "data.samples_per_gpu=4",
        "data.num_samples=24",
        "runner.max_epochs=2",
        "evaluation.num_samples=8",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn each_models_config_builds_and_trains_with_its_evaluation() {
    watchdog(600, || {
        // The classifier: README's main job, every block checkpointed.
        let sets = classifier_sets(&["model.backbone.with_cp=true"]);
        let file = "resnet18_synthetic.toml";
        let report = run(file, &sets, Purpose::Train, Shard::whole(), Some("cls")).unwrap();
        assert_eq!(
            (report.batch, report.hooks, report.batches_per_epoch),
            (4, 1, 6)
        );
        assert_eq!((report.with_cp, report.keys), (WithCp::On, BACKBONE_KEYS));
        let log = report.log.unwrap();
        assert_eq!(
            log.matches("(8 held-out samples)").count(),
            2,
            "an accuracy line after each epoch: {log}"
        );
        // The detector, on a synthetic VOC set.
        let data = tempfile::tempdir().unwrap();
        let root =
            memsave_models_next::data::voc::synth::write_synthetic_voc(data.path(), 8, 3).unwrap();
        let mut sets = synthvoc_sets(&root);
        sets.push("model.backbone.with_cp=true".into());
        sets.push("model.bbox_head.with_cp=true".into());
        let file = "retinanet_r18_fpn_synthvoc.toml";
        let report = run(file, &sets, Purpose::Train, Shard::whole(), Some("det")).unwrap();
        assert_eq!(
            (report.batch, report.hooks, report.batches_per_epoch),
            (2, 1, 3)
        );
        assert_eq!(report.with_cp, WithCp::On);
        assert_eq!(report.keys, DETECTOR_KEYS);
        let log = report.log.unwrap();
        assert_eq!(log.matches("evaluation at epoch").count(), 2, "{log}");
        assert!(log.contains("mAP: "), "{log}");
    });
}

#[test]
fn the_seed_draws_the_weights_and_a_measuring_job_or_a_later_peer_evaluates_nothing() {
    watchdog(300, || {
        let file = "resnet18_synthetic.toml";
        let sets = classifier_sets(&[]);
        let first = run(file, &sets, Purpose::Train, Shard::whole(), None).unwrap();
        let again = run(file, &sets, Purpose::Train, Shard::whole(), None).unwrap();
        assert!(
            first.weights == again.weights,
            "the same seed, the same weights"
        );
        let sets = classifier_sets(&["seed=1"]);
        let other = run(file, &sets, Purpose::Train, Shard::whole(), None).unwrap();
        assert!(first.weights != other.weights, "the seed is read");
        assert_eq!(first.hooks, 1);
        let sets = classifier_sets(&[]);
        let measuring = run(file, &sets, Purpose::Measure, Shard::whole(), None).unwrap();
        assert_eq!(measuring.hooks, 0, "no evaluation data read to measure");
        let peer = Shard { rank: 1, world: 2 };
        let later = run(file, &sets, Purpose::Train, peer, None).unwrap();
        assert_eq!(later.hooks, 0, "rank 0 evaluates a data-parallel run");
        assert_eq!(
            later.batches_per_epoch, 3,
            "half of the 24 samples in batches of 4"
        );
        assert!(
            later.weights == first.weights,
            "every peer starts from the same weights"
        );
    });
}

#[test]
fn keys_batches_and_scales_are_read_and_bad_sections_name_their_key() {
    let _turn = common::one_at_a_time();
    let classifier = configs().join("resnet18_synthetic.toml");
    let detector = configs().join("retinanet_r18_fpn_synthvoc.toml");
    assert_eq!(entry(&classifier, &[]).unwrap().keys, BACKBONE_KEYS);
    assert!(entry(&detector, &[]).unwrap().detector);
    assert_eq!(batch_size(&classifier, &[]).unwrap(), 8);
    assert_eq!(
        batch_size(&detector, &["data.samples_per_gpu=3".into()]).unwrap(),
        3
    );
    assert!(multiscale_training(&classifier, &[]).unwrap().is_none());
    assert!(
        multiscale_training(&detector, &[]).unwrap().is_none(),
        "one scale"
    );
    let range = "data.train.pipeline=[{ type = \"LoadImageFromFile\" }, { type = \"Resize\", \
                 img_scale = [[320, 160], [320, 240]], keep_ratio = true }, { type = \
                 \"Normalize\", mean = [0.0, 0.0, 0.0], std = [1.0, 1.0, 1.0] }]";
    let multi = multiscale_training(&detector, &[range.into()])
        .unwrap()
        .unwrap();
    assert_eq!(multi.extremes(), ([320, 160], [320, 240]));
    let error = |file: &str, sets: &[&str]| -> String {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        run(file, &sets, Purpose::Train, Shard::whole(), None)
            .err()
            .unwrap()
            .to_string()
    };
    let message = error(
        "retinanet_r18_fpn_synthvoc.toml",
        &["model.bbox_head.num_classes=4"],
    );
    assert!(message.contains("model.bbox_head.num_classes"), "{message}");
    let message = error("resnet18_synthetic.toml", &["evaluation.metric=\"mAP\""]);
    assert!(message.contains("evaluation.metric"), "{message}");
    let message = error("resnet18_synthetic.toml", &["evaluation.num_samples=0"]);
    assert!(message.contains("evaluation.num_samples"), "{message}");
    let message = error("resnet18_synthetic.toml", &["model.type=\"Transformer\""]);
    assert!(message.contains("model.type"), "{message}");
}
