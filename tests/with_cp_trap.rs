//! The checkpointing trap no compiler can catch: a block with a `with_cp` flag, switched on by its
//! parent's `#[with_cp]` field, whose forward is not marked `#[with_cp]`. It would train
//! without checkpointing, silently. The first step names it, the same way everywhere: memsave's
//! runner, burn-train's adapter, `memsave::check` and a user's own loop end with an error by
//! default, and warn where the run says so (`unused_with_cp = "warn"`). A block whose forward
//! is marked, and a block switched off, are not reported. The types that ran are the run's:
//! the tests here share nothing and take no lock.

mod common;

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
        let logits = self.logits(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        burn::train::ClassificationOutput::new(loss, logits, batch.labels)
    }
}

/// burn-train's adapter: by default the first step's error stops the training (no step is
/// taken: the weights stay) and `Memsave::finish` returns it; where the run says to warn, the
/// warning is among `Memsave::warnings` and the training steps.
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
        let (before, after) = train(&strict);
        let error = strict
            .finish()
            .expect_err("an error by default")
            .to_string();
        assert!(error.contains("`Unmarked`"), "{error}");
        assert_eq!(before, after, "no step after the error");
        assert!(strict.finish().is_ok(), "the error is handed over once");

        let lenient = Memsave::new().unused_with_cp(UnusedWithCp::Warn).unwrap();
        let (before, after) = train(&lenient);
        lenient.finish().unwrap();
        assert_ne!(before, after, "it trained");
        let warnings = lenient.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("`Unmarked`"), "{warnings:?}");
    });
}
