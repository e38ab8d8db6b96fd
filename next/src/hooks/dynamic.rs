//! `with_cp = "dynamic"` in memsave's runner on Burn 0.22: the engine of a user's own loop
//! ([`Dynamic`], memsave-common's `DynamicMemory`) as a hook. The run's first step is profiled
//! with every segment checkpointed; from then on each segment chooses at its entry whether to
//! keep its activations, so that every step keeps the budget at any input size, exactly.

use std::cell::RefCell;
use std::rc::Rc;

use burn::tensor::Device;

use crate::checkpoint::{set_with_cp, CheckpointModule};
use crate::planner::{Budget, Dynamic, IntervalFigures, ModelKeys, OWN_LOOP_KEYS};
use crate::train::{Hook, TrainModel, TrainState};
use crate::Result;

/// `with_cp = "dynamic"` in the runner (see the module docs). Register it with
/// [`crate::train::Runner::register_hook`]; its figures are read after the run through
/// [`DynamicHook::figures`].
pub struct DynamicHook {
    dynamic: Dynamic,
    figures: Rc<RefCell<IntervalFigures>>,
}

impl DynamicHook {
    /// Keeps `budget` on `device`; an error where the device's memory cannot be read.
    pub fn new(budget: Budget, device: &Device) -> Result<Self> {
        Self::with_keys(budget, OWN_LOOP_KEYS, device)
    }

    /// [`DynamicHook::new`], its errors and advice naming the config's keys.
    pub fn with_keys(budget: Budget, keys: ModelKeys, device: &Device) -> Result<Self> {
        Ok(DynamicHook {
            dynamic: Dynamic::with_keys(budget, keys, device)?,
            figures: Rc::default(),
        })
    }

    /// Says the figures every `interval` steps (the log's interval).
    pub fn with_log_interval(mut self, interval: usize) -> Self {
        self.dynamic = self.dynamic.with_log_interval(interval);
        self
    }

    /// The figures of the run so far (shared: read them after the run): steps, segments kept
    /// and recomputed, the highest step peak and the budget, per input size.
    pub fn figures(&self) -> Rc<RefCell<IntervalFigures>> {
        self.figures.clone()
    }
}

impl<M: TrainModel + CheckpointModule> Hook<M> for DynamicHook {
    fn name(&self) -> &'static str {
        "dynamic"
    }

    fn before_run(&mut self, state: &mut TrainState<M>) -> Result<()> {
        state.model = self.dynamic.start(state.model.clone());
        // A forward copy the optimizer hook made already (mixed precision) is switched on too;
        // the later ones are made from the switched masters.
        if let Some(copy) = state.forward_model.take() {
            state.forward_model = Some(set_with_cp(copy, true));
        }
        Ok(())
    }

    /// The step begins at its forward, on the model as the forward runs it (the optimizer
    /// hook's taps, for the step in backward, make it afresh: a segment is known by its
    /// module's place in memory); a second pass keeps the first's choices.
    fn before_forward(&mut self, state: &mut TrainState<M>) -> Result<()> {
        if state.pass == 0 {
            self.dynamic.begin_step(state.forward_model());
        } else {
            self.dynamic.first_pass_done(state.forward_model());
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<M>) -> Result<()> {
        let ended = self.dynamic.end_step(&state.model, state.log.overflow);
        *self.figures.borrow_mut() = self.dynamic.figures();
        ended?;
        Ok(())
    }

    fn after_run(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        self.dynamic.end();
        Ok(())
    }
}
