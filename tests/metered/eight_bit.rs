//! 8-bit optimizer state (`[optimizer] state_dtype = "int8"`, REFERENCE.md section 7): a
//! quarter of the memory, a resumed run continuing with the same bits, training close to the
//! fp32 state's, and the settings that cannot work refused by name.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::module::Module;
use common::mlp::Mlp;
use common::tiny::Seeded;
use common::AB;
use memsave::config::Config;
use memsave::hooks::{LrSchedule, LrUpdaterHook, OptimizerHook, SnapshotHook};
use memsave::memory;
use memsave::models::config::{ClassifierSection, DataSection};
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::train::snapshot::codec::record_bytes;
use memsave::train::{
    Optim, OptimizerKind, OptimizerSpec, RunLength, Runner, Snapshot, StateDtype, TrainState,
};

/// One test at a time: the memory test reads the process-wide allocator's counts.
use crate::TURN as SERIAL;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn data(batch: usize, samples: usize) -> SyntheticClassification<AB> {
    let mut config = SyntheticClassificationConfig::new(batch, samples, 8);
    config.seed = 3;
    config.noise = 1.0;
    config.signal = 0.5;
    SyntheticClassification::new(config, 4, Default::default()).unwrap()
}

fn mlp() -> Mlp<AB> {
    Mlp::new(3 * 8 * 8, 256, 3, 0.0, &Default::default()).map(&mut Seeded(5))
}

fn adam_w() -> OptimizerKind {
    OptimizerKind::AdamW {
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

fn sgd() -> OptimizerKind {
    OptimizerKind::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
        nesterov: false,
    }
}

fn work_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-int8-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn runner(
    model: Mlp<AB>,
    optimizer: &OptimizerSpec,
    (iters, batch): (usize, usize),
    lr: f64,
    dir: &Path,
) -> Runner<AB, Mlp<AB>, SyntheticClassification<AB>> {
    let mut runner = Runner::new(
        model,
        optimizer,
        Box::new(OptimizerHook::new()),
        data(batch, 1024),
        RunLength::Iters(iters),
        dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(lr),
    }));
    runner
}

/// Bytes the optimizer's state holds in memory: what is freed when it is replaced by a fresh
/// one.
fn state_bytes(state: &mut TrainState<AB, Mlp<AB>>, spec: &OptimizerSpec) -> u64 {
    let before = memory::current_bytes() as u64;
    state.optimizer = Optim::new(spec);
    before.saturating_sub(memory::current_bytes() as u64)
}

#[test]
fn the_8_bit_state_takes_a_quarter_of_the_memory() {
    let _serial = serial();
    let mut bytes = Vec::new();
    for dtype in [StateDtype::F32, StateDtype::Int8] {
        for kind in [sgd(), adam_w()] {
            let spec = kind.with_state_dtype(dtype);
            let dir = work_dir("memory");
            let mut runner = runner(mlp(), &spec, (2, 4), 0.01, &dir);
            runner.run().unwrap();
            bytes.push(state_bytes(runner.state_mut(), &spec));
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let (trainable, _) = memsave::train::params::param_bytes::<AB, _>(&mlp());
    eprintln!("state bytes, fp32 sgd/adamw then int8: {bytes:?}; weights {trainable}");
    // fp32: one copy (momentum), two (moments).
    assert!(bytes[0] >= trainable * 9 / 10 && bytes[1] >= trainable * 18 / 10);
    // 8 bits: a quarter, plus the scales and the small tensors kept in fp32.
    assert!(bytes[2] * 10 < bytes[0] * 3, "{} vs {}", bytes[2], bytes[0]);
    assert!(bytes[3] * 10 < bytes[1] * 3, "{} vs {}", bytes[3], bytes[1]);
}

/// The model's record and the optimizer's state after `runner` ran.
fn outcome(runner: &Runner<AB, Mlp<AB>, SyntheticClassification<AB>>) -> (Vec<u8>, Vec<u8>) {
    let state = runner.state();
    (
        record_bytes::<AB, _>(state.model.clone().into_record()).unwrap(),
        state.optimizer.to_bytes().unwrap(),
    )
}

#[test]
fn a_resumed_run_continues_with_the_same_bits() {
    let _serial = serial();
    for kind in [sgd(), adam_w()] {
        let spec = kind.with_state_dtype(StateDtype::Int8);
        let start = mlp();
        let dir = work_dir("resume");
        let mut whole = runner(start.clone(), &spec, (6, 4), 0.01, &dir);
        whole.register_hook(Box::new(SnapshotHook::new(3, false)));
        whole.run().unwrap();
        let snapshot = dir.join("iter_3.ckpt");
        assert!(snapshot.exists());
        // The snapshot holds the codes as bytes: far less than the fp32 state would take.
        let file = std::fs::metadata(&snapshot).unwrap().len();
        let (weights, _) = memsave::train::params::param_bytes::<AB, _>(&start);
        let copies = spec.kind.state_copies();
        assert!(
            file < weights + weights * copies / 3,
            "{file} bytes for {weights} of weights"
        );
        let loaded = Snapshot::load(&snapshot).unwrap();
        assert_eq!(loaded.meta.iter, 3);

        let mut resumed = runner(start, &spec, (6, 4), 0.01, &dir.join("resumed"));
        resumed.resume(&snapshot).unwrap();
        resumed.run().unwrap();
        assert!(
            outcome(&whole) == outcome(&resumed),
            "{:?}: the resumed run differs",
            spec.kind
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn training_with_8_bit_state_follows_the_fp32_states_losses() {
    let _serial = serial();
    // Burn's own initialisation (the seeded one is too wide for these layers).
    let start = Mlp::<AB>::new(3 * 8 * 8, 256, 3, 0.0, &Default::default());
    for (kind, lr) in [(sgd(), 0.05), (adam_w(), 0.001)] {
        let mut losses = Vec::new();
        for dtype in [StateDtype::F32, StateDtype::Int8] {
            let spec = kind.clone().with_state_dtype(dtype);
            let dir = work_dir("losses");
            let log = std::sync::Arc::new(Mutex::new(Vec::new()));
            struct Losses(std::sync::Arc<Mutex<Vec<f64>>>);
            impl memsave::train::Hook<AB, Mlp<AB>> for Losses {
                fn name(&self) -> &'static str {
                    "losses"
                }
                fn after_iter(
                    &mut self,
                    state: &mut TrainState<AB, Mlp<AB>>,
                ) -> memsave::Result<()> {
                    self.0.lock().unwrap().extend(state.log.loss);
                    Ok(())
                }
            }
            let mut runner = runner(start.clone(), &spec, (48, 16), lr, &dir);

            runner.register_hook(Box::new(Losses(log.clone())));
            runner.run().unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            let log = log.lock().unwrap().clone();
            losses.push(log);
        }
        // The whole curve after the first epoch, and its last epoch.
        let mean = |losses: &[f64]| losses.iter().sum::<f64>() / losses.len() as f64;
        let (first, curve, last) = (
            mean(&losses[0][..16]),
            mean(&losses[0][16..]),
            mean(&losses[0][32..]),
        );
        let (int8_curve, int8_last) = (mean(&losses[1][16..]), mean(&losses[1][32..]));
        eprintln!(
            "{kind:?}: fp32 {first:.4} -> {curve:.4} -> {last:.4}, int8 {int8_curve:.4} -> \
             {int8_last:.4}"
        );
        assert!(last < first * 0.8, "fp32 did not learn: {first} -> {last}");
        assert!(
            (int8_curve - curve).abs() <= 0.25 * curve && int8_last < first * 0.8,
            "int8 {int8_curve} vs fp32 {curve}"
        );
        assert_ne!(losses[0], losses[1], "the 8-bit state changed nothing");
    }
}

fn config(extra: &str) -> memsave::Result<Config<ClassifierSection, DataSection>> {
    let path = std::env::temp_dir().join(format!(
        "memsave-int8-{}-{}.toml",
        std::process::id(),
        extra.len()
    ));
    std::fs::write(
        &path,
        format!(
            "_base_ = \"{}/configs/resnet18_synthetic.toml\"\n{extra}",
            env!("CARGO_MANIFEST_DIR")
        ),
    )
    .unwrap();
    let config = Config::load(&path, &[]);
    let _ = std::fs::remove_file(&path);
    config
}

#[test]
fn the_state_dtype_is_read_and_bad_values_are_errors_naming_the_key() {
    let _turn = crate::TURN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let on = config("[optimizer]\nstate_dtype = \"int8\"\n").unwrap();
    assert_eq!(on.optimizer().state_dtype, StateDtype::Int8);
    assert_eq!(config("").unwrap().optimizer().state_dtype, StateDtype::F32);
    let message = config("[optimizer]\nstate_dtype = \"int4\"\n")
        .unwrap_err()
        .to_string();
    assert!(message.contains("optimizer.state_dtype"), "{message}");
    let message = config("[optimizer]\nstate_dtype = \"int8\"\nmomentum = 0.0\n")
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("optimizer.state_dtype") && message.contains("momentum"),
        "{message}"
    );
}
