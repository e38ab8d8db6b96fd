//! `with_cp = "dynamic"` in memsave's runner on Burn 0.22 (`memsave_next::hooks::DynamicHook`):
//! every step keeps the budget at every batch size, and the weights are the plain run's, bit for
//! bit.

mod common;

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
use memsave_next::planner::Budget;
use memsave_next::train::{DataSource, Hook, RunLength, Runner, TrainModel, TrainState};

#[global_allocator]
static ALLOCATOR: memory::CountingAllocator = memory::CountingAllocator;

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

#[test]
fn the_runner_keeps_a_dynamic_budget_at_every_batch_size_and_trains_as_plain() {
    watchdog(300, || {
        let device = device();
        device.seed(5);
        let start = initialized(Net {
            blocks: blocks(&device, 6),
        });
        let sizes = vec![192, 128, 160, 96, 192, 128, 64, 160];
        let run = |dynamic: bool| {
            let mut runner = Runner::new(
                start.clone(),
                SgdConfig::new().init(),
                Box::new(OptimizerHook::new()),
                Sizes(sizes.clone()),
                RunLength::Epochs(1),
                std::env::temp_dir().join("memsave-next-runner-dynamic"),
                device.clone(),
            )
            .unwrap();
            runner.set_lr(0.01).unwrap();
            let hook = dynamic.then(|| DynamicHook::new(Budget::Fraction(0.8), &device).unwrap());
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
        };
        let (plain, plain_peaks, _) = run(false);
        let (dynamic, peaks, figures) = run(true);
        let figures = figures.unwrap();
        println!("plain peaks {plain_peaks:?}\ndynamic peaks {peaks:?}\n{figures:?}");
        assert_eq!(
            figures.steps,
            sizes.len() - 1,
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
        // The budget binds: plain goes over it at the largest batch.
        assert!(
            plain_peaks[4] > figures.budget,
            "{plain_peaks:?} {figures:?}"
        );
        assert!(figures.kept > 0 && figures.recomputed > 0, "{figures:?}");
        assert_eq!(plain, dynamic, "the weights after {} steps", sizes.len());
    });
}
