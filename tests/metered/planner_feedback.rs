//! `with_cp = "auto"` in training: the plan applies from the second step, and a checked step
//! whose measured peak is over the budget makes the planner checkpoint more, and say so in
//! train.log. (The over-budget peak is a probe's: the real one is within the budget.)

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use memsave::fp16::Precision;
use memsave::hooks::OptimizerHook;
use memsave::memory::Meter;
use memsave::models::classifier::ClassificationBatch;
use memsave::models::classifier::ImageClassifier;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::models::registry::BACKBONE_KEYS;
use memsave::models::resnet::ResNetConfig;
use memsave::planner::advise::Setting;
use memsave::planner::{AutoPlanHook, Budget};
use memsave::scaler::{LossScaler, ScaleMode};
use memsave::train::{OptimizerKind, RunLength, Runner, TrainModel};

type B = Autodiff<Flex>;

/// The profiles read the process's counting allocator (each run's recorder is its own, the bytes
/// are not): these tests take turns.
use crate::TURN;

/// Reports a peak far over any budget.
struct Over;

impl Meter for Over {
    fn live(&self) -> u64 {
        0
    }
    fn reset_peak(&self) -> u64 {
        0
    }
    fn peak(&self) -> u64 {
        u64::MAX / 4
    }
    fn window_peak(&self) -> u64 {
        u64::MAX / 4
    }
}

#[test]
fn a_step_over_the_budget_adds_segments_and_says_so() {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    common::watchdog(300, || {
        let device = Default::default();
        let mut backbone = ResNetConfig::default();
        backbone.depth = 18;
        backbone.base_channels = 8;
        let model = ImageClassifier::<B>::new(&backbone, 4, &device).unwrap();
        let data = SyntheticClassification::<B>::new(
            SyntheticClassificationConfig::new(4, 16, 64),
            4,
            device,
        )
        .unwrap();
        let work_dir = common::fresh_dir("planner_feedback", "over");
        let mut runner = Runner::new(
            model,
            &OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: false,
            },
            Box::new(OptimizerHook::new()),
            data,
            RunLength::Iters(3),
            &work_dir,
            device,
        )
        .unwrap();
        runner.set_lr(0.01).unwrap();
        let setting = Setting {
            fp16: false,
            micro_batch: 4,
            cumulative: 1,
            adam: false,
            step_in_backward: false,
            int8_state: false,
            clips: false,
            offload_activations: false,
            offload_optimizer: false,
            weight_dtype: Default::default(),
        };
        // The whole unplanned peak: nothing needs checkpointing at first.
        let planner = AutoPlanHook::new(Budget::Fraction(1.0), setting, BACKBONE_KEYS, &device)
            .unwrap()
            .with_check_meter(Box::new(Over));
        let current = planner.plan_handle();
        runner.register_hook(Box::new(planner));
        runner.run().unwrap();
        let log = std::fs::read_to_string(work_dir.join("train.log")).unwrap();
        assert!(log.contains("plan: checkpoint 0 of 8 segments"), "{log}");
        assert!(log.contains("plan: step 2: budget="), "{log}");
        assert!(log.contains("over the budget by"), "{log}");
        assert!(log.contains("checkpointing 8 more segment(s)"), "{log}");
        assert_eq!(current.borrow().len(), 8);
    })
}

/// The classifier, whose fourth forward fails as a device allocator does when it is full.
#[memsave::model]
#[derive(Module, Debug)]
struct Failing<B: burn::prelude::Backend> {
    #[with_cp]
    inner: ImageClassifier<B>,
}

static FORWARDS: AtomicUsize = AtomicUsize::new(0);

impl<B: AutodiffBackend + memsave::Backend> TrainModel<B> for Failing<B> {
    type Batch = ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        if FORWARDS.fetch_add(1, Ordering::SeqCst) == 3 {
            panic!("can't allocate buffer of size: 1048576");
        }
        self.inner.loss(batch)
    }
}

#[test]
fn a_device_out_of_memory_after_the_plan_ends_with_what_would_fit() {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    common::watchdog(300, || {
        let device = Default::default();
        let mut backbone = ResNetConfig::default();
        backbone.depth = 18;
        backbone.base_channels = 8;
        let model = Failing {
            inner: ImageClassifier::<B>::new(&backbone, 4, &device).unwrap(),
        };
        let data = SyntheticClassification::<B>::new(
            SyntheticClassificationConfig::new(4, 16, 64),
            4,
            device,
        )
        .unwrap();
        let work_dir = common::fresh_dir("planner_feedback", "oom");
        let mut runner = Runner::new(
            model,
            &OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: false,
            },
            Box::new(OptimizerHook::new()),
            data,
            RunLength::Iters(6),
            &work_dir,
            device,
        )
        .unwrap();
        runner.set_lr(0.01).unwrap();
        let setting = Setting {
            fp16: false,
            micro_batch: 4,
            cumulative: 1,
            adam: false,
            step_in_backward: false,
            int8_state: false,
            clips: false,
            offload_activations: false,
            offload_optimizer: false,
            weight_dtype: Default::default(),
        };
        let planner =
            AutoPlanHook::new(Budget::Fraction(1.0), setting, BACKBONE_KEYS, &device).unwrap();
        runner.register_hook(Box::new(planner));
        let error = runner.run().unwrap_err().to_string();
        eprintln!("{error}");
        assert!(
            error.starts_with("not enough memory: iteration 3"),
            "{error}"
        );
        assert!(error.contains("did not fit"), "{error}");
        assert!(error.contains("what would fit"), "{error}");
        assert!(error.contains("memsave plan"), "{error}");
    })
}

#[test]
fn a_step_skipped_on_an_overflow_is_not_profiled_the_next_one_is() {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    common::watchdog(300, || {
        let device = Default::default();
        let mut backbone = ResNetConfig::default();
        backbone.depth = 18;
        backbone.base_channels = 8;
        let model = ImageClassifier::<B>::new(&backbone, 4, &device).unwrap();
        let data = SyntheticClassification::<B>::new(
            SyntheticClassificationConfig::new(4, 16, 64),
            4,
            device,
        )
        .unwrap();
        let work_dir = common::fresh_dir("planner_feedback", "overflow");
        // A dynamic scale from 2^24 overflows f16's gradients on the first steps; with the
        // step in backward such a step runs its first pass only.
        let hook = OptimizerHook::new()
            .with_step_in_backward(true)
            .with_mixed_precision(
                LossScaler::new((1u64 << 24) as f64, ScaleMode::Dynamic, 2.0, 2000).unwrap(),
                Precision::F16,
            );
        let mut runner = Runner::new(
            model,
            &OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: false,
            },
            Box::new(hook),
            data,
            RunLength::Iters(16),
            &work_dir,
            device,
        )
        .unwrap();
        runner.set_lr(0.01).unwrap();
        let setting = Setting {
            fp16: true,
            micro_batch: 4,
            cumulative: 1,
            adam: false,
            step_in_backward: true,
            int8_state: false,
            clips: false,
            offload_activations: false,
            offload_optimizer: false,
            weight_dtype: Default::default(),
        };
        let planner =
            AutoPlanHook::new(Budget::Fraction(1.0), setting, BACKBONE_KEYS, &device).unwrap();
        runner.register_hook(Box::new(planner));
        runner.run().unwrap();
        let log = std::fs::read_to_string(work_dir.join("train.log")).unwrap();
        // 2^24 overflows f16 at first: the skipped steps are passed over, and the plan is made
        // from the first step that updates.
        assert!(
            log.contains("plan: iteration 0 was skipped on a gradient overflow"),
            "{log}"
        );
        let last_skip = log.rfind("was skipped on a gradient overflow").unwrap();
        let plan = log.find("plan: checkpoint").expect("a plan");
        assert!(plan > last_skip, "planned from a skipped step: {log}");
    })
}
