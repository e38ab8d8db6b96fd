//! Snapshots on Burn 0.22 (issue 55, items 1 and 7): a run saved and resumed continues bit for
//! bit (the model's parameters and ids, its running statistics, the optimizer's state, the loss
//! scaler); a snapshot written by memsave on Burn 0.21 is refused naming the version that wrote
//! it; a damaged file, another model, or another optimizer is an error naming the file.

use crate::common;

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use common::mlp::{loss_at, Mlp};
use common::{device, param_bits, watchdog};
use memsave_next::amp::MixedPrecision;
use memsave_next::fp16::Precision;
use memsave_next::scaler::{LossScaler, ScaleMode};
use memsave_next::snapshot::{load_weights, FormatError, Snapshot, SnapshotCause};
use memsave_next::Error;

const SIZES: [usize; 3] = [8, 16, 4];

fn dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "memsave-next-snapshot-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The error of `result`, which must be one (`ModuleOptimizer` has no `Debug`).
fn failure<T>(result: Result<T, Error>) -> Error {
    match result {
        Ok(_) => panic!("an error was expected"),
        Err(error) => error,
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("next/ is inside the workspace")
        .join("tests/fixtures/snapshots")
        .join(name)
}

/// A scaler that moves within a few steps (window 2), so a resume that forgets it differs.
fn amp() -> MixedPrecision {
    MixedPrecision::new(
        Precision::F16,
        LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 2).unwrap(),
    )
}

/// Mixed-precision steps `steps` on the fp32 masters.
fn train(
    mut masters: Mlp,
    optimizer: &mut ModuleOptimizer,
    amp: &mut MixedPrecision,
    steps: std::ops::Range<usize>,
) -> Mlp {
    for step in steps {
        let half = amp.half_model(&masters);
        let grads = amp.backward(loss_at(&half, step));
        masters = amp.step(optimizer, 1e-2, masters, &half, grads).0;
    }
    masters
}

fn ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

fn saved(masters: &Mlp, optimizer: &ModuleOptimizer, amp: &MixedPrecision, path: &Path) {
    Snapshot::new(3, 0)
        .with_model(masters)
        .unwrap()
        .with_optimizer(optimizer)
        .unwrap()
        .with_precision("f16")
        .with_hook("fp16", amp.scaler())
        .unwrap()
        .save(path)
        .unwrap();
}

#[test]
fn a_resumed_mixed_precision_run_continues_bit_for_bit() {
    watchdog(120, || {
        let dir = dir("resume");
        device().seed(11);
        let start = Mlp::new(&device(), SIZES);
        let adamw = || AdamWConfig::new().with_weight_decay(1e-2).init();

        let (mut optimizer, mut scaler) = (adamw(), amp());
        let straight = train(start.clone(), &mut optimizer, &mut scaler, 0..6);
        let final_scale = scaler.scaler().loss_scale();

        let (mut optimizer, mut scaler) = (adamw(), amp());
        let half_way = train(start, &mut optimizer, &mut scaler, 0..3);
        let path = dir.join("iter_3.ckpt");
        saved(&half_way, &optimizer, &scaler, &path);
        assert_ne!(
            scaler.scaler().loss_scale(),
            1024.0,
            "the scale moved, so that a resume that forgot it would differ"
        );

        // Another start (other weights, other ids): everything must come from the file.
        device().seed(99);
        let fresh = Mlp::new(&device(), SIZES);
        let snapshot = Snapshot::load(&path).unwrap();
        assert_eq!((snapshot.meta.iter, snapshot.meta.epoch), (3, 0));
        assert_eq!(snapshot.meta.precision.as_deref(), Some("f16"));
        assert_eq!(snapshot.meta.burn_version, "0.22.1");
        let (masters, mut optimizer) = snapshot.restore(fresh.clone(), adamw()).unwrap();
        assert_eq!(ids(&masters), ids(&half_way), "the parameter ids come back");
        assert_eq!(param_bits(&masters), param_bits(&half_way));
        let mut resumed_amp = amp();
        resumed_amp
            .restore_scaler(snapshot.hook("fp16").unwrap())
            .unwrap();
        let resumed = train(masters.clone(), &mut optimizer, &mut resumed_amp, 3..6);
        assert_eq!(param_bits(&resumed), param_bits(&straight), "bit for bit");
        assert_eq!(resumed_amp.scaler().loss_scale(), final_scale);

        // Seen to differ: without the optimizer's state, and without the scaler's.
        let mut forgetful = adamw();
        let without_state = train(masters.clone(), &mut forgetful, &mut amp(), 3..6);
        assert_ne!(param_bits(&without_state), param_bits(&straight));
        let (masters, mut optimizer) = snapshot.restore(fresh, adamw()).unwrap();
        let mut fresh_amp = amp();
        let _ = train(masters, &mut optimizer, &mut fresh_amp, 3..6);
        assert_ne!(fresh_amp.scaler().loss_scale(), final_scale);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[derive(Module, Debug)]
struct Normed {
    fc: Linear,
    norm: BatchNorm,
}

impl Normed {
    fn new(device: &Device) -> Self {
        Normed {
            fc: LinearConfig::new(6, 5).init(device),
            norm: BatchNormConfig::new(5).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let y: Tensor<3> = self.fc.forward(x).unsqueeze_dim(2);
        self.norm.forward(y).squeeze_dim(2)
    }
}

#[test]
fn running_statistics_and_16_bit_weights_come_back_as_saved() {
    watchdog(120, || {
        let dir = dir("running");
        device().seed(5);
        let mut model = Normed::new(&device());
        let mut optimizer = SgdConfig::new().init();
        for step in 0..3 {
            let x = Tensor::<2>::random(
                [16, 6],
                burn::tensor::Distribution::Normal(step as f64, 2.0),
                &device(),
            );
            let grads = model.forward(x).powi_scalar(2).mean().backward();
            let grads = burn::optim::GradientsParams::from_grads(grads, &model);
            model = optimizer.step(0.1, model, grads);
        }
        let path = dir.join("normed.ckpt");
        Snapshot::new(3, 0)
            .with_model(&model)
            .unwrap()
            .save(&path)
            .unwrap();
        // Read after the save: the last step's update waits until a read merges it, and the
        // snapshot must hold it (a save that read the value without merging would not).
        let mean = model.norm.running_mean.value_sync();
        assert!(mean.clone().abs().sum().into_scalar::<f32>() > 0.0, "moved");
        // Weights only, for inference: the running statistics included.
        let loaded = load_weights(Normed::new(&device()), &path).unwrap();
        assert_eq!(
            common::bits(loaded.norm.running_mean.value()),
            common::bits(mean)
        );
        assert_eq!(
            common::bits(loaded.norm.running_var.value()),
            common::bits(model.norm.running_var.value_sync())
        );
        assert_eq!(param_bits(&loaded), param_bits(&model));
        let error = failure(
            Snapshot::load(&path)
                .unwrap()
                .load_optimizer(SgdConfig::new().init()),
        )
        .to_string();
        assert!(
            error.contains("normed.ckpt") && error.contains("no optimizer state"),
            "{error}"
        );

        // 16-bit weights are saved in their type and come back in it.
        let half = memsave_next::fp16::cast_params(model.clone(), Precision::Bf16);
        Snapshot::new(3, 0)
            .with_model(&half)
            .unwrap()
            .save(&path)
            .unwrap();
        let loaded = load_weights(Normed::new(&device()), &path).unwrap();
        assert_eq!(loaded.fc.weight.val().dtype(), burn::tensor::DType::BF16);
        assert_eq!(param_bits(&loaded), param_bits(&half));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// The snapshot memsave on Burn 0.22 keeps for the 0.21 reader's test (`tests/suite/runner.rs`),
/// written again with `MEMSAVE_WRITE_FIXTURES=1`; it must keep loading here.
#[test]
fn the_kept_0_22_snapshot_loads_and_a_0_21_one_is_refused_naming_its_version() {
    watchdog(120, || {
        let kept = fixture("written-on-burn-0.22.ckpt");
        let model = || {
            let device = device();
            device.seed(1);
            Mlp::new(&device, SIZES)
        };
        if std::env::var_os("MEMSAVE_WRITE_FIXTURES").is_some() {
            let (mut optimizer, mut scaler) = (AdamWConfig::new().init(), amp());
            let trained = train(model(), &mut optimizer, &mut scaler, 0..3);
            std::fs::create_dir_all(kept.parent().unwrap()).unwrap();
            saved(&trained, &optimizer, &scaler, &kept);
        }
        let snapshot = Snapshot::load(&kept).unwrap();
        assert_eq!(snapshot.meta.memsave_version, "0.1.0");
        let (masters, _) = snapshot
            .restore(model(), AdamWConfig::new().init())
            .unwrap();
        assert_ne!(
            param_bits(&masters),
            param_bits(&model()),
            "trained weights"
        );

        // Written by memsave on Burn 0.21 (its runner, `tests/suite/runner.rs`): refused by name.
        let older = fixture("written-on-burn-0.21.ckpt");
        let error = Snapshot::load(&older).unwrap_err();
        let said = error.to_string();
        for part in [
            "written-on-burn-0.21.ckpt",
            "written by memsave 0.1.0 on Burn 0.21",
            "runs on Burn 0.22",
            "resume this run with the memsave on Burn 0.21",
        ] {
            assert!(said.contains(part), "{part:?} in {said}");
        }
        assert!(
            matches!(
                &error,
                Error::Snapshot {
                    source: Some(SnapshotCause::Format(FormatError::Version {
                        found: 1,
                        reads: 2,
                        ..
                    })),
                    ..
                }
            ),
            "{error:?}"
        );
    });
}

#[test]
fn damaged_files_other_models_and_other_optimizers_are_errors_naming_the_file() {
    watchdog(300, || {
        let dir = dir("bad");
        device().seed(2);
        let model = Mlp::new(&device(), SIZES);
        let (mut optimizer, mut scaler) = (AdamWConfig::new().init(), amp());
        let model = train(model, &mut optimizer, &mut scaler, 0..2);
        let path = dir.join("good.ckpt");
        saved(&model, &optimizer, &scaler, &path);
        let good = std::fs::read(&path).unwrap();

        // Every truncation, and a flipped bit anywhere: an error naming the file.
        let cut = dir.join("cut.ckpt");
        for length in (0..good.len()).step_by(good.len() / 97 + 1) {
            let error = Snapshot::from_bytes(&good[..length], &cut).unwrap_err();
            assert!(error.to_string().contains("cut.ckpt"), "{length}: {error}");
        }
        for at in (0..good.len()).step_by(good.len() / 31 + 1) {
            let mut flipped = good.clone();
            flipped[at] ^= 0x10;
            let said = Snapshot::from_bytes(&flipped, &cut)
                .unwrap_err()
                .to_string();
            assert!(
                said.contains("checksum") || said.contains("not a memsave"),
                "{at}: {said}"
            );
        }
        let missing = dir.join("missing.ckpt");
        let error = Snapshot::load(&missing).unwrap_err();
        assert!(matches!(error, Error::Io { .. }) && error.to_string().contains("missing.ckpt"));

        // A whole file (checksum right) whose records are not Burn's.
        let mut garbage = Snapshot::from_bytes(&good, &path).unwrap();
        garbage.model = b"not a burnpack record".to_vec();
        garbage.optimizer = vec![0xff; 40];
        let garbled = dir.join("garbled.ckpt");
        garbage.save(&garbled).unwrap();
        let snapshot = Snapshot::load(&garbled).unwrap();
        let said = snapshot.load_model(model.clone()).unwrap_err().to_string();
        assert!(
            said.contains("garbled.ckpt") && said.contains("the model's record is unreadable"),
            "{said}"
        );
        let said = failure(snapshot.load_optimizer(AdamWConfig::new().init())).to_string();
        assert!(
            said.contains("the optimizer's state is unreadable"),
            "{said}"
        );

        // Another model: the first parameter that differs, with both shapes.
        let snapshot = Snapshot::load(&path).unwrap();
        let other = Mlp::new(&device(), [8, 32, 4]);
        let said = snapshot.load_model(other).unwrap_err().to_string();
        assert!(
            said.contains("good.ckpt")
                && said.contains("another model")
                && said.contains("parameter 0 is [8, 16] there and [8, 32] here"),
            "{said}"
        );

        // Another optimizer: Burn's own load would drop AdamW's moments without a word.
        for (name, other) in [
            (
                "SGD with momentum",
                SgdConfig::new()
                    .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
                    .init(),
            ),
            (
                "8-bit AdamW",
                memsave_next::optim8::Adam8::adamw()
                    .with_eight_bit(true)
                    .init()
                    .unwrap(),
            ),
        ] {
            let said = failure(snapshot.load_optimizer(other)).to_string();
            assert!(
                said.contains("good.ckpt") && said.contains("another optimizer"),
                "{name}: {said}"
            );
        }
        // The same optimizer reads it.
        snapshot.load_optimizer(AdamWConfig::new().init()).unwrap();
        // A burnpack that is not an optimizer's (the model's, in the optimizer's section).
        let mut foreign = snapshot.clone();
        foreign.optimizer = foreign.model.clone();
        let said = failure(foreign.load_optimizer(AdamWConfig::new().init())).to_string();
        assert!(said.contains("optimizer"), "{said}");

        // A scaler state that is not one.
        let error = amp()
            .restore_scaler(&serde_json::json!({ "loss_scale": "high" }))
            .unwrap_err();
        assert!(error.to_string().contains("loss"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    });
}
