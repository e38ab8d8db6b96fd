//! The step meter: the time and peak live bytes of a range of iterations.

use std::cell::RefCell;
use std::rc::Rc;

use burn::tensor::backend::AutodiffBackend;

use crate::memory::Meter;
use crate::train::{Hook, TrainModel, TrainState};
use crate::Result;

/// Measures iterations `from..to`: the time of each and its peak live bytes.
pub struct StepMeter {
    /// The first iteration measured.
    pub from: usize,
    /// The iteration after the last one measured.
    pub to: usize,
    /// Per measured iteration: seconds and peak bytes.
    pub steps: Rc<RefCell<Vec<(f64, u64)>>>,
    meter: Box<dyn Meter>,
    started: Option<std::time::Instant>,
}

impl StepMeter {
    /// Measures iterations `from..to`, memory read by `meter`.
    pub fn new(from: usize, to: usize, meter: Box<dyn Meter>) -> Self {
        StepMeter {
            from,
            to,
            steps: Rc::new(RefCell::new(Vec::new())),
            meter,
            started: None,
        }
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for StepMeter {
    fn name(&self) -> &'static str {
        "step_meter"
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if (self.from..self.to).contains(&state.iter) {
            let _ = B::sync(&state.device);
            self.meter.window_peak();
            self.started = Some(std::time::Instant::now());
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if let Some(started) = self.started.take() {
            let _ = B::sync(&state.device);
            let seconds = started.elapsed().as_secs_f64();
            let peak = self.meter.window_peak();
            self.steps.borrow_mut().push((seconds, peak));
        }
        Ok(())
    }
}
