//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod dp;
pub mod mlp;
pub mod sometimes;
pub mod tiny;
pub mod trap;

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::DType;

pub type AB = Autodiff<Flex>;

/// Runs `f` on its own thread and fails the test if it does not end within `seconds` (a hang
/// in a backward pass must fail, not block CI). A panic in `f` is passed on.
pub fn watchdog<T: Send + 'static>(seconds: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let result = f();
        let _ = sender.send(());
        result
    });
    match receiver.recv_timeout(Duration::from_secs(seconds)) {
        Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("no result after {seconds} s: a hang"),
    }
}

/// The tests whose training steps panic take turns. memsave's panic hook keeps the panics of
/// every thread of the process, and a step that fails reads them to tell an out-of-memory from
/// another panic: one test's "can't allocate" would make another test's panic an out-of-memory.
/// Taken before any other turn.
pub fn panicking_steps() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The next value of a splitmix64 generator: seeded, reproducible draws that do not touch
/// Flex's process-wide random stream (tests run in parallel).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Forces every lazy parameter to initialise, so that clones share their values.
pub struct Materialise;
impl<B: Backend> ModuleMapper<B> for Materialise {}

/// Every parameter's gradient, flattened to fp32, by parameter id (absent: no gradient), on any
/// autodiff backend.
pub fn param_grads<B: burn::tensor::backend::AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &B::Gradients,
) -> HashMap<ParamId, Vec<f32>> {
    struct Collect<'a, B: burn::tensor::backend::AutodiffBackend> {
        grads: &'a B::Gradients,
        out: HashMap<ParamId, Vec<f32>>,
    }
    impl<B: burn::tensor::backend::AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = param.val().grad(self.grads) {
                let values = grad.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
                self.out.insert(param.id, values);
            }
        }
    }
    let mut collect = Collect::<B> {
        grads,
        out: HashMap::new(),
    };
    model.visit(&mut collect);
    collect.out
}

/// `max |a - b| / max |b|`.
pub fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "gradients of different sizes");
    let scale = b
        .iter()
        .fold(0.0_f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0_f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// Asserts that two runs gave every parameter the same gradient (within `tolerance`,
/// relative), and that they gave gradients to the same parameters. Returns the worst
/// difference.
pub fn assert_same_grads(
    with: &HashMap<ParamId, Vec<f32>>,
    without: &HashMap<ParamId, Vec<f32>>,
    tolerance: f32,
) -> f32 {
    assert!(
        !without.is_empty(),
        "the reference run produced no gradient"
    );
    let mut ids: Vec<_> = without.keys().collect();
    ids.sort_by_key(|id| id.to_string());
    let mut worst = 0.0_f32;
    for id in ids {
        let reference = &without[id];
        let got = with
            .get(id)
            .unwrap_or_else(|| panic!("parameter {id} has no gradient with the strategy on"));
        let difference = max_relative_difference(got, reference);
        assert!(
            difference <= tolerance,
            "parameter {id}: relative difference {difference} > {tolerance}"
        );
        worst = worst.max(difference);
    }
    assert_eq!(
        with.len(),
        without.len(),
        "different sets of parameters got gradients"
    );
    worst
}

/// A tensor's values, flattened, as fp32.
pub fn values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

/// The `--set` overrides that switch each strategy on, by name: none, mixed precision with
/// `loss_scale` (a TOML value), accumulation over 2, checkpointing of the backbone.
pub fn strategy_overrides(loss_scale: &'static str) -> Vec<(&'static str, Vec<String>)> {
    vec![
        ("plain", vec![]),
        (
            "fp16",
            vec!["--set".into(), format!("fp16.loss_scale={loss_scale}")],
        ),
        (
            "accumulation",
            vec![
                "--set".into(),
                "optimizer_config.type=\"GradientCumulativeOptimizerHook\"".into(),
                "--set".into(),
                "optimizer_config.cumulative_iters=2".into(),
            ],
        ),
        (
            "checkpointing",
            vec!["--set".into(), "model.backbone.with_cp=true".into()],
        ),
    ]
}

/// Runs the `memsave` binary with `args`.
pub fn memsave(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args(args)
        .output()
        .expect("the memsave binary runs")
}

/// A fresh temporary folder for one test, `memsave-<suite>-<pid>-<name>`.
pub fn fresh_dir(suite: &str, name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
