//! `with_cp = "dynamic"` in memsave's runner: memsave-common's engine ([`DynamicMemory`]; its
//! module docs say how the budget is kept at every input size) as a training hook. The engine
//! is the same on Burn 0.22 (`memsave_next::planner::Dynamic`).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use burn::tensor::backend::AutodiffBackend;

pub use memsave_common::planner::dynamic::{
    choose_offloaded, compare_multiscale, floor_offloaded, holds_most, scaled, DynamicMemory,
    IntervalFigures, MultiScaleComparison, OverSizes, StepEnd, PROFILE_SPAN,
};

use super::auto::note;
use super::profile_hook::{segment_ids, set_flags};
use super::{Budget, ModelKeys, Profile};
use crate::checkpoint::CheckpointModule;
use crate::memory::{peer_meter_for, Meter};
use crate::train::params::{trainable_elements, trainable_layout};
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// CPU staging's counts on Burn 0.21: activation offload's bytes copied, the host's
/// optimizer-step seconds.
pub(crate) fn staged() -> memsave_common::planner::Staged {
    Arc::new(|| {
        (
            crate::checkpoint::offload_stats().bytes,
            crate::train::host_step_seconds(),
        )
    })
}

/// `with_cp = "dynamic"` in training (see [`DynamicMemory`]): profiles the run's first step,
/// then keeps `budget` in every later one, segment by segment, at any input size.
pub struct DynamicHook {
    engine: DynamicMemory,
    /// Whether the first profile is taken: until it is, each step sets every segment on again
    /// before it runs (the forward copy another hook made since the run began included).
    profiled: bool,
    make_meter: Box<dyn Fn() -> Option<Box<dyn Meter>>>,
    interval: usize,
    figures: Rc<RefCell<IntervalFigures>>,
}

impl DynamicHook {
    /// Keeps `budget` on `device`; `keys` name the model's settings in errors.
    pub fn new<D: Clone + 'static>(budget: Budget, keys: ModelKeys, device: &D) -> Result<Self> {
        let meter = peer_meter_for(device).ok_or_else(|| {
            Error::invalid(
                keys.with_cp,
                format!(
                    "\"dynamic\" reads the memory in use as each step runs, and the device `{}` \
                     has no meter memsave can read: memsave's counting allocator is not this \
                     program's global allocator (see memsave::memory), and the device is not a \
                     CubeCL one (CUDA, wgpu)",
                    std::any::type_name::<D>()
                ),
            )
        })?;
        let device = device.clone();
        Ok(DynamicHook {
            engine: DynamicMemory::new(budget, keys, meter, staged()),
            profiled: false,
            make_meter: Box::new(move || peer_meter_for(&device)),
            interval: 50,
            figures: Rc::new(RefCell::new(IntervalFigures::default())),
        })
    }

    /// Reports the choices every `interval` iterations (the log's interval).
    pub fn with_log_interval(mut self, interval: usize) -> Self {
        self.interval = interval.max(1);
        self
    }

    /// The profiles taken so far (the first, and one per input size far from the others), and
    /// the budget in bytes.
    pub fn profiled(&self) -> (Vec<Profile>, u64) {
        self.engine.profiled()
    }

    /// The figures of the whole run so far (shared, for reading after the run).
    pub fn figures(&self) -> Rc<RefCell<IntervalFigures>> {
        self.figures.clone()
    }
}

impl<B: AutodiffBackend, M: TrainModel<B> + CheckpointModule> Hook<B, M> for DynamicHook {
    fn name(&self) -> &'static str {
        "dynamic"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        set_flags(state, &|_| true);
        // CPU staging is the third choice where it can save something: priced by the link.
        let staging = crate::checkpoint::offload::can_offload::<B::InnerBackend>()
            .ok()
            .map(|()| {
                crate::checkpoint::measure_link::<B::InnerBackend>(&state.device, 16 << 20)
                    .map_or(0.0, |link| link.slower())
            });
        self.engine.start(staging);
        Ok(())
    }

    fn after_run(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        self.engine.end();
        Ok(())
    }

    fn before_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if !self.profiled {
            set_flags(state, &|_| true);
        }
        self.engine
            .begin_step((self.make_meter)(), segment_ids(state.forward_model()));
        Ok(())
    }

    fn after_first_pass(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        self.engine
            .first_pass_done(segment_ids(state.forward_model()));
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        let end = StepEnd {
            iter: state.iter,
            overflow: state.log.overflow,
            // The trainable bytes in fp32 (the optimizer state's and the sums' unit): the
            // masters', on the host under mixed precision with optimizer offload.
            trainable_elements: trainable_elements::<B, M>(&state.model),
            // The gradients are the forward model's (half under mixed precision).
            layout: trainable_layout::<B, M>(state.forward_model()),
            report: state.every_n_iters(self.interval) || state.is_last_iter(),
        };
        let lines = self.engine.end_step(end);
        *self.figures.borrow_mut() = self.engine.figures();
        self.profiled = self.profiled || !self.engine.profiled().0.is_empty();
        for line in lines? {
            note(state, &line);
        }
        Ok(())
    }
}
