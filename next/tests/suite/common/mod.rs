//! What memsave-next's tests share: gradients as bits, Burn's two checkpointing strategies, and
//! a watchdog (a backward inside a backward step waits on graph locks: a mistake there hangs).

#![allow(dead_code)]

pub mod blocks;
pub mod mlp;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::Gradients;

/// Every float parameter's gradient, as bits (`None` where it has none), in visiting order.
struct GradBits<'a>(&'a Gradients, Vec<Option<Vec<u32>>>);

impl ModuleVisitor for GradBits<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.1.push(param.val().grad(self.0).map(bits));
    }
}

/// A tensor's values as f32 bits.
pub fn bits<const D: usize>(tensor: Tensor<D>) -> Vec<u32> {
    tensor
        .into_data()
        .convert::<f32>()
        .as_slice::<f32>()
        .expect("f32 data")
        .iter()
        .map(|value| value.to_bits())
        .collect()
}

/// Every float parameter's value, as bits, in `module`'s visiting order.
pub fn param_bits<M: Module>(module: &M) -> Vec<Vec<u32>> {
    struct Values(Vec<Vec<u32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(bits(param.val()));
        }
    }
    let mut values = Values(Vec::new());
    module.visit(&mut values);
    values.0
}

/// Every float parameter's gradient in `grads`, as bits, in `module`'s visiting order.
pub fn grad_bits<M: Module>(module: &M, grads: &Gradients) -> Vec<Option<Vec<u32>>> {
    let mut visitor = GradBits(grads, Vec::new());
    module.visit(&mut visitor);
    visitor.1
}

/// Flex with autodiff (Burn's checkpointing off): the device of the tests that vary nothing else.
pub fn device() -> Device {
    Device::flex().autodiff()
}

/// Flex with autodiff, under each of Burn's checkpointing strategies.
pub fn devices() -> [(&'static str, Device); 2] {
    [
        ("Burn's checkpointing off", Device::flex().autodiff()),
        (
            "Burn's Balanced checkpointing",
            Device::flex().autodiff().gradient_checkpointing(),
        ),
    ]
}

/// This test's turn: the tests of a binary run one at a time. Flex's random generator is one for
/// the process and the tests compare runs that seed it; the counting allocator counts the whole
/// process and the tests read it. Held until the guard drops.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `catch_unwind` with the panic hook silenced while `f` runs: for code a test makes panic on
/// purpose. Where `RUST_BACKTRACE` is set, the default hook prints a backtrace, and reading the
/// binary's symbols for it keeps tens of MiB for the rest of the process (45 MiB after the
/// Learner's panic), which the tests that read the counting allocator would count as theirs.
/// The hook is the process's: safe because tests take turns ([`one_at_a_time`]).
pub fn catch_quietly<R>(f: impl FnOnce() -> R) -> std::thread::Result<R> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    result
}

/// Runs `f` on a thread of its own, in its turn ([`one_at_a_time`]), and fails if it has not
/// ended after `seconds`.
pub fn watchdog(seconds: u64, f: impl FnOnce() + Send + 'static) {
    let _turn = one_at_a_time();
    let (sender, receiver) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        f();
        let _ = sender.send(());
    });
    match receiver.recv_timeout(std::time::Duration::from_secs(seconds)) {
        Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("no result after {seconds} s: a hang")
        }
    }
}

/// Fails with where `actual` differs from `expected` (gradients as [`grad_bits`] gives them): the
/// first parameter whose gradient differs, by its index, and how.
#[track_caller]
pub fn assert_same_bits(expected: &[Option<Vec<u32>>], actual: &[Option<Vec<u32>>], what: &str) {
    assert_eq!(
        expected.len(),
        actual.len(),
        "{what}: the number of parameters"
    );
    for (index, (expected, actual)) in expected.iter().zip(actual).enumerate() {
        match (expected, actual) {
            (None, None) => {}
            (Some(_), None) => panic!("{what}: parameter {index} has no gradient"),
            (None, Some(_)) => panic!("{what}: parameter {index} has a gradient it should not"),
            (Some(expected), Some(actual)) => {
                let differ = expected.iter().zip(actual).filter(|(a, b)| a != b).count();
                assert!(
                    differ == 0 && expected.len() == actual.len(),
                    "{what}: parameter {index}: {differ} of {} values differ (first: {:?} against \
                     {:?})",
                    expected.len(),
                    expected
                        .iter()
                        .zip(actual)
                        .find(|(a, b)| a != b)
                        .map(|(a, _)| f32::from_bits(*a)),
                    expected
                        .iter()
                        .zip(actual)
                        .find(|(a, b)| a != b)
                        .map(|(_, b)| f32::from_bits(*b)),
                );
            }
        }
    }
}

/// Initializes `module`'s parameters now: Burn initializes one on its first use, drawing from the
/// backend's random stream, so a test that compares two runs' streams does it before the first.
pub fn initialized<M: Module>(module: M) -> M {
    struct Read;
    impl ModuleVisitor for Read {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            drop(param.val());
        }
    }
    module.visit(&mut Read);
    module
}

/// Fails where `actual` differs from `expected` by more than `tolerance`, relative to the larger
/// magnitude of the two (with a floor of 1), or where one has a gradient and the other none;
/// returns the largest difference.
#[track_caller]
pub fn assert_close(
    expected: &[Option<Vec<u32>>],
    actual: &[Option<Vec<u32>>],
    tolerance: f32,
    what: &str,
) -> f32 {
    assert_eq!(
        expected.len(),
        actual.len(),
        "{what}: the number of parameters"
    );
    let mut worst = 0.0_f32;
    for (index, (expected, actual)) in expected.iter().zip(actual).enumerate() {
        match (expected, actual) {
            (None, None) => {}
            (Some(expected), Some(actual)) => {
                for (a, b) in expected.iter().zip(actual) {
                    let (a, b) = (f32::from_bits(*a), f32::from_bits(*b));
                    let difference = (a - b).abs() / a.abs().max(b.abs()).max(1.0);
                    assert!(
                        difference <= tolerance,
                        "{what}: parameter {index}: {a} against {b}"
                    );
                    worst = worst.max(difference);
                }
            }
            _ => panic!("{what}: parameter {index}: a gradient on one side only"),
        }
    }
    worst
}
