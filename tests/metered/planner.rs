//! The planner end to end on a small ResNet classifier: the profile names every block by its
//! module path, a plan for a budget between the floor of checkpointing and the unplanned peak
//! keeps the measured peak of the following steps within that budget (and near the
//! prediction), and its gradients are those of the plain model. One test: the peak is the
//! process's.

use crate::common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::tensor::Tensor;
use memsave::checkpoint::{join_helpers, segment_paths, set_with_cp_paths};
use memsave::hooks::OptimizerHook;
use memsave::memory::AllocatorMeter;
use memsave::models::classifier::ImageClassifier;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::models::resnet::ResNetConfig;
use memsave::planner::{plan, ProfileHook, StepMeter};
use memsave::train::{DataSource, OptimizerKind, RunLength, Runner, TrainModel};

type B = Autodiff<Flex>;

fn model(device: &burn::tensor::Device<B>) -> ImageClassifier<B> {
    let mut backbone = ResNetConfig::default();
    backbone.depth = 18;
    backbone.base_channels = 16;
    <B as burn::prelude::Backend>::seed(device, 7);
    let model = ImageClassifier::new(&backbone, 4, device).unwrap();
    // Every (lazy) weight drawn now, in one order, whatever is checkpointed later.
    memsave::train::params::param_bytes::<B, _>(&model);
    model
}

fn data(device: &burn::tensor::Device<B>) -> SyntheticClassification<B> {
    SyntheticClassification::new(
        SyntheticClassificationConfig::new(8, 32, 224),
        4,
        device.clone(),
    )
    .unwrap()
}

fn sgd() -> OptimizerKind {
    OptimizerKind::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
        nesterov: false,
    }
}

/// Every parameter's gradient, in visiting order.
struct Collect<'a> {
    grads: &'a burn::optim::GradientsParams,
    out: Vec<Vec<f32>>,
}

impl burn::module::ModuleVisitor<B> for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.get::<Flex, D>(param.id) {
            self.out.push(grad.into_data().to_vec().unwrap());
        }
    }
}

#[test]
fn a_planned_resnet_stays_within_its_budget() {
    let _turn = crate::TURN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    common::watchdog(600, || {
        let device = Default::default();
        let paths = segment_paths(&model(&device));
        assert_eq!(paths.len(), 8);
        assert_eq!(paths[0], "backbone.layer1.0");
        assert_eq!(paths[7], "backbone.layer4.1");

        // The profile: a warm-up step, then one with every block checkpointed.
        let mut runner = Runner::new(
            model(&device),
            &sgd(),
            Box::new(OptimizerHook::new()),
            data(&device),
            RunLength::Iters(2),
            std::env::temp_dir().join("memsave-planner-e2e"),
            device,
        )
        .unwrap();
        runner.set_lr(0.01).unwrap();
        let profiler = ProfileHook::new(1, Box::new(AllocatorMeter));
        let taken = profiler.profile.clone();
        runner.register_hook(Box::new(profiler));
        runner.run().unwrap();
        drop(runner);
        join_helpers().unwrap();
        let profile = taken.take().expect("profiled");
        let names: Vec<&str> = profile.segments.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(names, paths.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(profile
            .segments
            .iter()
            .all(|s| s.kept_bytes > 0 && s.recompute_seconds > 0.0));
        // Early blocks keep more than late ones at this resolution.
        assert!(profile.segments[0].kept_bytes > profile.segments[7].kept_bytes);

        // Half way from checkpointing everything to nothing (on the CPU, each recomputation's
        // helper thread holds the matrix library's scratch until backward ends, so everything
        // is not always the least).
        let (floor, unplanned) = (profile.floor(), profile.unplanned_peak());
        let budget = floor.min(unplanned) + floor.abs_diff(unplanned) / 2;
        let chosen = plan(&profile, budget).unwrap();
        assert!(chosen.peak <= budget, "{chosen:?}");
        assert!(chosen.paths.len() < paths.len(), "{chosen:?}");
        let error = plan(&profile, floor.min(unplanned) / 2).unwrap_err();
        assert!(error.floor <= floor.min(unplanned));
        assert!(error.to_string().contains("below the floor"), "{error}");

        // The plan, applied to a fresh model: its measured peaks stay within the budget.
        let planned = set_with_cp_paths(model(&device), &chosen.paths).unwrap();
        let mut runner = Runner::new(
            planned,
            &sgd(),
            Box::new(OptimizerHook::new()),
            data(&device),
            RunLength::Iters(3),
            std::env::temp_dir().join("memsave-planner-e2e"),
            device,
        )
        .unwrap();
        runner.set_lr(0.01).unwrap();
        let meter = StepMeter::new(1, 3, Box::new(AllocatorMeter));
        let steps = meter.steps.clone();
        runner.register_hook(Box::new(meter));
        runner.run().unwrap();
        drop(runner);
        join_helpers().unwrap();
        for (_, measured) in steps.take() {
            assert!(
                measured <= budget,
                "measured {measured} over the budget {budget} (predicted {})",
                chosen.peak
            );
            let error = (chosen.peak as f64 - measured as f64).abs() / measured as f64;
            assert!(error < 0.1, "predicted {} measured {measured}", chosen.peak);
        }

        // The plan's gradients are the plain model's, bit for bit.
        let batch = data(&device).batch(0, 0, &device).unwrap();
        let grads_of = |model: ImageClassifier<B>| {
            let loss = model.loss(batch.clone());
            let grads = loss.backward();
            join_helpers().unwrap();
            let grads = burn::optim::GradientsParams::from_grads(grads, &model);
            let mut collect = Collect {
                grads: &grads,
                out: Vec::new(),
            };
            model.visit(&mut collect);
            assert!(!collect.out.is_empty());
            collect.out
        };
        let plain = grads_of(model(&device));
        let planned = grads_of(set_with_cp_paths(model(&device), &chosen.paths).unwrap());
        assert_eq!(plain, planned);
    })
}
