use burn::tensor::backend::AutodiffBackend;

use crate::train::{Hook, TrainModel, TrainState};
use crate::Result;

pub use memsave_common::train::lr::{LrSchedule, Policy, Warmup};

/// Sets `state.lr` before each iteration from a [`LrSchedule`].
#[derive(Clone, Debug)]
pub struct LrUpdaterHook {
    /// The schedule.
    pub schedule: LrSchedule,
}

impl LrUpdaterHook {
    /// The hook of `schedule`, checked (errors name the parameter).
    pub fn new(schedule: LrSchedule) -> Result<Self> {
        schedule.validate()?;
        Ok(LrUpdaterHook { schedule })
    }

    /// A constant learning rate `lr` (a finite number, at least 0; errors name `lr`).
    pub fn constant(lr: f64) -> Result<Self> {
        LrUpdaterHook::new(LrSchedule::constant(lr))
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for LrUpdaterHook {
    fn name(&self) -> &'static str {
        "lr"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.schedule.by_epoch.get_or_insert(state.by_epoch);
        Ok(())
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        state.lr = self.schedule.lr_at(state.iter, state.epoch);
        Ok(())
    }
}
