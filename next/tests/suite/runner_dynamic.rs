//! `with_cp = "dynamic"` in memsave's runner on Burn 0.22 (`memsave_next::hooks::DynamicHook`):
//! every step keeps the budget at every batch size, and the weights are the plain run's, bit for
//! bit.

use crate::common;

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::optim::SgdConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use common::blocks::{blocks, Block, NARROW};
use common::{device, initialized, param_bits, watchdog};
use memsave_macros::model;
use memsave_next::hooks::{DynamicHook, OptimizerHook};
use memsave_next::memory;
use memsave_next::planner::{Budget, IntervalFigures};
use memsave_next::train::{DataSource, Hook, RunLength, Runner, TrainModel, TrainState};

#[model]
#[derive(Module, Debug)]
struct Net {
    #[with_cp]
    blocks: Vec<Block>,
}

impl TrainModel for Net {
    type Batch = Tensor<2>;

    fn loss(&self, x: Tensor<2>) -> Tensor<1> {
        let y = self.blocks.iter().fold(x, |x, block| block.forward(x));
        y.powi_scalar(2).mean()
    }
}

/// Batches of the sizes given, one epoch; each drawn from a seed of its own.
struct Sizes(Vec<usize>);

impl DataSource<Tensor<2>> for Sizes {
    fn batches_per_epoch(&self) -> usize {
        self.0.len()
    }

    fn batch(
        &self,
        _epoch: usize,
        index: usize,
        device: &Device,
    ) -> memsave_next::Result<Tensor<2>> {
        device.seed(100 + index as u64);
        // Tracked, so that the first block is checkpointed too (MMCV's guard).
        Ok(
            Tensor::<2>::random([self.0[index], NARROW], Distribution::Default, device)
                .require_grad(),
        )
    }
}

/// Each step's peak, as the counting allocator reads it.
#[derive(Clone, Default)]
struct Peaks(Arc<Mutex<Vec<u64>>>);

impl Hook<Net> for Peaks {
    fn name(&self) -> &'static str {
        "peaks"
    }

    fn before_iter(&mut self, state: &mut TrainState<Net>) -> memsave_next::Result<()> {
        memory::meter_for(&state.device).unwrap().reset_peak();
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<Net>) -> memsave_next::Result<()> {
        let peak = memory::meter_for(&state.device).unwrap().peak();
        self.0.lock().unwrap().push(peak);
        Ok(())
    }
}

type Ran = (Vec<Vec<u32>>, Vec<u64>, Option<IntervalFigures>);

const SIZES: [usize; 8] = [192, 128, 160, 96, 192, 128, 64, 160];

/// Six wide blocks trained one epoch of [`SIZES`]: under `"dynamic"` at `share` of the first
/// step's unplanned peak where given, stepping in backward where asked.
fn run(share: Option<f64>, in_backward: bool) -> Ran {
    let device = device();
    device.seed(5);
    let start = initialized(Net {
        blocks: blocks(&device, 6),
    });
    let mut runner = Runner::new(
        start,
        SgdConfig::new().init(),
        Box::new(OptimizerHook::new().with_step_in_backward(in_backward)),
        Sizes(SIZES.to_vec()),
        RunLength::Epochs(1),
        std::env::temp_dir().join("memsave-next-runner-dynamic"),
        device.clone(),
    )
    .unwrap();
    runner.set_lr(0.01).unwrap();
    let hook = share.map(|share| DynamicHook::new(Budget::Fraction(share), &device).unwrap());
    let figures = hook.as_ref().map(DynamicHook::figures);
    if let Some(hook) = hook {
        runner.register_hook(Box::new(hook));
    }
    let peaks = Peaks::default();
    runner.register_hook(Box::new(peaks.clone()));
    runner.run().unwrap();
    let figures = figures.map(|figures| figures.borrow().clone());
    let peaks = peaks.0.lock().unwrap().clone();
    (param_bits(&runner.into_model()), peaks, figures)
}

/// Every step after the profile within the budget, as the engine and the test's meter read it.
fn within_budget(peaks: &[u64], figures: &IntervalFigures) {
    assert_eq!(
        figures.steps,
        SIZES.len() - 1,
        "every step after the profile"
    );
    assert!(
        figures.highest_peak <= figures.budget,
        "a step peaked at {} over the budget {}",
        figures.highest_peak,
        figures.budget
    );
    for (step, peak) in peaks.iter().enumerate() {
        assert!(
            *peak <= figures.budget,
            "step {step}: {peak} over {}",
            figures.budget
        );
    }
}

#[test]
fn the_runner_keeps_a_dynamic_budget_at_every_batch_size_and_trains_as_plain() {
    watchdog(300, || {
        let (plain, plain_peaks, _) = run(None, false);
        let (dynamic, peaks, figures) = run(Some(0.8), false);
        let figures = figures.unwrap();
        println!("plain peaks {plain_peaks:?}\ndynamic peaks {peaks:?}\n{figures:?}");
        within_budget(&peaks, &figures);
        // The budget binds: plain goes over it at the largest batch.
        assert!(
            plain_peaks[4] > figures.budget,
            "{plain_peaks:?} {figures:?}"
        );
        assert!(figures.kept > 0 && figures.recomputed > 0, "{figures:?}");
        assert_eq!(plain, dynamic, "the weights after {} steps", SIZES.len());
    });
}

#[test]
fn dynamic_with_the_step_in_backward_keeps_a_lower_budget_and_trains_as_plain() {
    watchdog(300, || {
        let (plain, plain_peaks, _) = run(None, false);
        let (dynamic, peaks, figures) = run(Some(0.7), true);
        let figures = figures.unwrap();
        println!("plain peaks {plain_peaks:?}\nin backward, dynamic at 70%: peaks {peaks:?}\n{figures:?}");
        within_budget(&peaks, &figures);
        assert!(figures.kept > 0 && figures.recomputed > 0, "{figures:?}");
        assert_eq!(plain, dynamic, "the weights after {} steps", SIZES.len());
    });
}
