//! The checkpointing trap no compiler can catch: a block with a `with_cp` flag, switched on by its
//! parent's `#[with_cp]` field, whose forward is not marked `#[with_cp]`. It would train
//! without checkpointing, silently. The first step names it, the same way everywhere: memsave's
//! runner, burn-train's adapter, `memsave::check` and a user's own loop end with an error by
//! default, and warn where the run says so (`unused_with_cp = "warn"`). A block whose forward
//! is marked, and a block switched off, are not reported. The types that ran are the run's:
//! the tests here share nothing and take no lock.

use crate::common;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use common::trap::Net;
use common::{watchdog, AB};
use memsave::check::switched_on_without_segment;
use memsave::checkpoint::{set_unused_with_cp, set_with_cp, UnusedWithCp};
use memsave::hooks::{LrSchedule, LrUpdaterHook, OptimizerHook};
use memsave::models::classifier::ClassificationBatch;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::train::{OptimizerKind, RunLength, Runner};

fn data() -> SyntheticClassification<AB> {
    SyntheticClassification::new(
        SyntheticClassificationConfig::new(4, 16, 8),
        4,
        Default::default(),
    )
    .unwrap()
}

fn run(model: Net<AB>, name: &str) -> memsave::Result<()> {
    let dir = std::env::temp_dir().join(format!("memsave-trap-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut runner = Runner::new(
        model,
        OptimizerKind::sgd(0.0),
        Box::new(OptimizerHook::new()),
        data(),
        RunLength::Iters(2),
        &dir,
        Default::default(),
    )?;
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.01),
    }));
    let result = runner.run();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[test]
fn a_block_switched_on_without_a_with_cp_method_ends_the_first_step_with_an_error_naming_it() {
    watchdog(120, || {
        let model = set_with_cp(Net::<AB>::new(&Default::default()), true);
        let error = run(model, "on")
            .expect_err("the trap trained silently")
            .to_string();
        assert!(error.contains("`Unmarked`"), "{error}");
        assert!(!error.contains("`Marked`"), "{error}");
        assert!(error.contains("#[with_cp]"), "{error}");
        assert!(error.contains("with_cp"), "{error}");
    });
}

#[test]
fn the_same_model_switched_off_trains() {
    watchdog(120, || {
        run(Net::<AB>::new(&Default::default()), "off").unwrap();
    });
}

#[test]
fn only_the_blocks_switched_on_are_named() {
    watchdog(120, || {
        let device = Default::default();
        let net = Net::<AB>::new(&device);
        // Only the marked blocks on: nothing to report once they ran.
        let mut net = Net {
            marked: set_with_cp(net.marked, true),
            ..net
        };
        let x = Tensor::<AB, 4>::ones([2, 3, 8, 8], &device).require_grad();
        let _ = net.logits(x.clone()).sum().backward();
        assert!(switched_on_without_segment(&net).is_empty());
        // The unmarked ones on too: they are named.
        net.unmarked = set_with_cp(net.unmarked, true);
        let _ = net.logits(x).sum().backward();
        assert_eq!(
            switched_on_without_segment(&net),
            vec!["Unmarked".to_string()]
        );
    });
}

#[test]
fn memsave_check_ends_with_an_error_naming_it_and_where_the_run_warns_says_the_forward_is_not_marked(
) {
    watchdog(120, || {
        let device = Default::default();
        let net = Net::<AB>::new(&device);
        let x = Tensor::<AB, 4>::ones([2, 3, 8, 8], &device);
        let loss = {
            let x = x.clone();
            move |net: &Net<AB>| net.logits(x.clone()).sum()
        };
        let error = memsave::check::check_model(net.clone(), loss)
            .expect_err("the trap is an error by default")
            .to_string();
        assert!(
            error.contains("`Unmarked`") && !error.contains("`Marked`"),
            "{error}"
        );
        set_unused_with_cp(UnusedWithCp::Warn);
        let report =
            memsave::check::check_model(net, move |net: &Net<AB>| net.logits(x.clone()).sum())
                .unwrap();
        println!("{report}");
        let unmarked = report
            .segments
            .iter()
            .find(|segment| segment.type_name == "Unmarked")
            .expect("the unmarked block is a segment");
        let why = unmarked.why_plain.as_deref().unwrap_or_default();
        assert!(why.contains("not marked `#[with_cp]`"), "{why}");
        assert!(!why.contains("guard"), "{why}");
        let marked = report
            .segments
            .iter()
            .find(|segment| segment.type_name == "Marked")
            .expect("the marked block is a segment");
        assert!(marked.checkpointed, "{marked:?}");
    });
}

/// The runner, where the run says to warn (`unused_with_cp = "warn"`, in its context): one
/// warning naming the block, in the run's warnings, and the run trains on.
#[test]
fn where_the_run_says_to_warn_the_runner_warns_once_and_trains_on() {
    watchdog(120, || {
        set_unused_with_cp(UnusedWithCp::Warn);
        let model = set_with_cp(Net::<AB>::new(&Default::default()), true);
        let dir = std::env::temp_dir().join(format!("memsave-trap-{}-warn", std::process::id()));
        let mut runner = Runner::new(
            model,
            OptimizerKind::sgd(0.0),
            Box::new(OptimizerHook::new()),
            data(),
            RunLength::Iters(3),
            &dir,
            Default::default(),
        )
        .unwrap();
        runner.register_hook(Box::new(LrUpdaterHook {
            schedule: LrSchedule::constant(0.01),
        }));
        runner.run().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let warnings = runner.state().warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("`Unmarked`"), "{warnings:?}");
        // The method's own signature or none: never one made up.
        assert!(!warnings[0].contains("Tensor<B"), "{warnings:?}");
    });
}

/// A user's own loop, in a scope of its own: `memsave::check::segments_ran` after the first
/// backward is the same error by default, the same warning where the run says so.
#[test]
fn a_users_loop_gets_the_same_error_by_default_and_the_warning_where_its_run_says_so() {
    watchdog(120, || {
        let device = Default::default();
        let net = set_with_cp(Net::<AB>::new(&device), true);
        let x = Tensor::<AB, 4>::ones([2, 3, 8, 8], &device);
        let step = |net: &Net<AB>| {
            let _ = net.logits(x.clone()).sum().backward();
            memsave::checkpoint::join_helpers().unwrap();
            memsave::check::segments_ran(net)
        };
        let strict = memsave::RunContext::named("strict loop");
        let error = strict
            .scope(|| step(&net))
            .unwrap()
            .expect_err("an error by default")
            .to_string();
        assert!(error.contains("`Unmarked`"), "{error}");
        let lenient = memsave::RunContext::named("lenient loop");
        let warned = lenient
            .scope(|| {
                set_unused_with_cp(UnusedWithCp::Warn);
                (step(&net).unwrap(), step(&net).unwrap())
            })
            .unwrap();
        assert!(
            warned
                .0
                .as_deref()
                .is_some_and(|w| w.contains("`Unmarked`")),
            "{warned:?}"
        );
        assert_eq!(
            warned.0, warned.1,
            "each call gives the warning's text (said once)"
        );
    });
}

impl<B: AutodiffBackend + memsave::Backend> memsave::burn_train::ForwardStep for Net<B> {
    type Input = ClassificationBatch<B>;
    type Output = burn::train::ClassificationOutput<B>;

    fn forward_step(&self, batch: ClassificationBatch<B>) -> Self::Output {
        FORWARD_STEPS.with(|steps| steps.set(steps.get() + 1));
        let logits = self.logits(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        burn::train::ClassificationOutput::new(loss, logits, batch.labels)
    }
}

thread_local! {
    /// The forward steps this thread ran (burn-train runs them on the thread that launches).
    static FORWARD_STEPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn forward_steps() -> usize {
    FORWARD_STEPS.with(std::cell::Cell::get)
}

/// burn-train's adapter driven by hand, with no burn-train loop to stop: by default the first
/// step's error is a panic at the optimizer step (no step is taken), naming the block and saying
/// how to get it as a `Result`; where the run says to warn, the warning is among
/// `Memsave::warnings` and the training steps.
#[test]
fn burn_trains_adapter_stops_with_the_error_by_default_and_warns_where_told() {
    use burn::optim::{Optimizer, SgdConfig};
    use burn::train::TrainStep;
    use memsave::burn_train::Memsave;
    watchdog(120, || {
        let device = Default::default();
        let batch = || ClassificationBatch::<AB> {
            images: Tensor::ones([2, 3, 8, 8], &device),
            labels: Tensor::from_data(TensorData::new(vec![0i64, 1], [2]), &device),
        };
        let weights = |net: &Net<AB>| common::values(net.head.weight.val().inner());
        let train = |memsave: &Memsave| {
            let net = set_with_cp(Net::<AB>::new(&device), true);
            let before = weights(&net);
            let model = memsave.model(net).unwrap();
            let mut optimizer = memsave.optimizer(SgdConfig::new().init());
            let mut model = model;
            for _ in 0..2 {
                let output = model.step(batch());
                model = Optimizer::step(&mut optimizer, 0.1, model, output.grads);
            }
            (before, weights(model.model()))
        };

        let strict = Memsave::new();
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| train(&strict)))
            .expect_err("an error by default, and nothing but a panic stops a loop");
        let message = panic_message(&panic);
        assert!(message.contains("`Unmarked`"), "{message}");
        assert!(message.contains("memsave.metrics()"), "{message}");
        assert!(message.contains("memsave.finish()"), "{message}");
        assert!(strict.finish().is_ok(), "the error was said by the panic");

        let lenient = Memsave::new().unused_with_cp(UnusedWithCp::Warn).unwrap();
        let (before, after) = train(&lenient);
        lenient.finish().unwrap();
        assert_ne!(before, after, "it trained");
        let warnings = lenient.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("`Unmarked`"), "{warnings:?}");
    });
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

// A whole burn-train program, as a new user writes it: the trap's net, burn-train's
// `SupervisedTraining`, no tracing subscriber. The error must reach the user whatever the
// program does with it.

/// burn-train's side of the trap's net, in inference.
impl<B: memsave::Backend> burn::train::InferenceStep for Net<B> {
    type Input = ClassificationBatch<B>;
    type Output = burn::train::ClassificationOutput<B>;

    fn step(&self, batch: ClassificationBatch<B>) -> Self::Output {
        let logits = self.logits(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        burn::train::ClassificationOutput::new(loss, logits, batch.labels)
    }
}

#[derive(Clone, Debug)]
struct Sample {
    image: Vec<f32>,
    label: i64,
}

#[derive(Clone)]
struct SampleBatcher;

impl<B: Backend> burn::data::dataloader::batcher::Batcher<B, Sample, ClassificationBatch<B>>
    for SampleBatcher
{
    fn batch(&self, samples: Vec<Sample>, device: &B::Device) -> ClassificationBatch<B> {
        let n = samples.len();
        let images: Vec<f32> = samples.iter().flat_map(|s| s.image.clone()).collect();
        let labels: Vec<i64> = samples.iter().map(|s| s.label).collect();
        ClassificationBatch {
            images: Tensor::from_data(TensorData::new(images, [n, 3, 8, 8]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// Micro-batches in the program's whole run: 2 epochs of 4 batches of 2.
const PROGRAM_STEPS: usize = 8;

/// Trains the trap's net through burn-train for 2 epochs, memsave's metrics registered or not,
/// and returns the `Memsave` (the program decides what to do with it).
fn burn_train_program(
    register_metrics: bool,
    dir: &std::path::Path,
) -> memsave::burn_train::Memsave {
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::data::dataset::InMemDataset;
    use burn::optim::SgdConfig;
    use burn::train::SupervisedTraining;
    let samples: Vec<Sample> = (0..PROGRAM_STEPS)
        .map(|i| Sample {
            image: (0..3 * 8 * 8)
                .map(|j| ((i * 7 + j) % 11) as f32 / 11.0)
                .collect(),
            label: (i % 4) as i64,
        })
        .collect();
    fn loader<B: Backend>(
        samples: &[Sample],
    ) -> std::sync::Arc<dyn burn::data::dataloader::DataLoader<B, ClassificationBatch<B>>> {
        DataLoaderBuilder::new(SampleBatcher)
            .batch_size(2)
            .build(InMemDataset::new(samples.to_vec()))
    }
    let memsave = memsave::burn_train::Memsave::new();
    let net = set_with_cp(Net::<AB>::new(&Default::default()), true);
    let learner = memsave
        .learner(net, SgdConfig::new().init(), 0.01)
        .expect("an fp32 net");
    let mut training = SupervisedTraining::new(dir, loader::<AB>(&samples), loader(&samples))
        .num_epochs(2)
        .with_application_logger(None);
    if register_metrics {
        training = training.metrics(memsave.metrics());
    }
    let _ = training.launch(learner);
    println!("trap program: launch returned");
    memsave
}

/// The program the tests below run as a child process (the test binary again, with
/// `MEMSAVE_TRAP_PROGRAM` set to `metrics` or `plain`): it never calls `Memsave::finish()`.
/// Without the variable it returns at once.
#[test]
fn trap_program_that_never_calls_finish() {
    let Ok(mode) = std::env::var("MEMSAVE_TRAP_PROGRAM") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("memsave-trap-program-{}", std::process::id()));
    let memsave = burn_train_program(mode == "metrics", &dir);
    let _ = std::fs::remove_dir_all(&dir);
    println!("trap program: stepped {}", forward_steps());
    // The end of `main`: the program never looks at the error.
    drop(memsave);
}

/// Runs [`trap_program_that_never_calls_finish`] in a child process, under a deadline;
/// returns its exit status and everything it printed.
fn run_trap_program(mode: &str) -> (std::process::ExitStatus, String) {
    use std::time::{Duration, Instant};
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::env::temp_dir().join(format!("memsave-trap-{mode}-{}.out", std::process::id()));
    let file = std::fs::File::create(&out).expect("a file for the child's output");
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "with_cp_trap::trap_program_that_never_calls_finish",
            "--nocapture",
        ])
        .args(["--test-threads", "1"])
        .env("MEMSAVE_TRAP_PROGRAM", mode)
        .env_remove("RUST_LOG")
        .stdout(file.try_clone().expect("the output file again"))
        .stderr(file)
        .spawn()
        .expect("the test binary runs again");
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child's status") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the trap program ran past 180 s: a hang");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    (status, output)
}

/// Without memsave's metrics nothing can stop burn-train's loop but a panic: the first step's
/// error ends the program at its optimizer step (exit code not 0), naming the block and what to
/// add.
#[test]
fn a_burn_train_program_without_finish_or_metrics_stops_at_the_first_step_with_the_error() {
    let (status, output) = run_trap_program("plain");
    assert!(!status.success(), "{output}");
    assert!(output.contains("memsave stopped the training"), "{output}");
    assert!(output.contains("`Unmarked`"), "{output}");
    assert!(output.contains("metrics(memsave.metrics())"), "{output}");
    assert!(
        !output.contains("trap program: launch returned"),
        "{output}"
    );
}

/// With memsave's metrics the training is stopped cleanly after the failing step; a program
/// that then ends without `Memsave::finish()` panics as its last handle drops, with the error.
#[test]
fn a_burn_train_program_that_never_calls_finish_still_ends_with_the_error() {
    let (status, output) = run_trap_program("metrics");
    assert!(!status.success(), "{output}");
    assert!(output.contains("trap program: launch returned"), "{output}");
    let stepped: usize = output
        .lines()
        .find_map(|line| line.strip_prefix("trap program: stepped "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count of micro-batches: {output}"));
    assert_eq!(
        stepped, 1,
        "the training stops after the failing step: {output}"
    );
    assert!(output.contains("memsave stopped the training"), "{output}");
    assert!(output.contains("`Unmarked`"), "{output}");
    assert!(output.contains("memsave.finish()"), "{output}");
}

/// The same program that takes the error: `finish()` returns it, and nothing panics.
#[test]
fn a_burn_train_program_that_calls_finish_gets_the_error_as_a_result() {
    watchdog(180, || {
        let dir = std::env::temp_dir().join(format!("memsave-trap-finish-{}", std::process::id()));
        let memsave = burn_train_program(true, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        let error = memsave
            .finish()
            .expect_err("the trap stopped it")
            .to_string();
        assert!(error.contains("`Unmarked`"), "{error}");
        assert_eq!(
            forward_steps(),
            1,
            "the training stops after the failing step"
        );
        drop(memsave);
    });
}
