//! The memory planner on Burn 0.22: a step measured with every segment checkpointed becomes a
//! [`Profile`] (per segment the bytes it would keep and its recomputation's time, per window of
//! the step its peak), and [`plan`] finds the checkpoint set that fits a budget at the least
//! recomputation time, exactly (memsave-common's planner, the same as on Burn 0.21).
//!
//! In a user's own loop:
//!
//! ```ignore
//! use memsave_next::memory::{in_phase, phase};
//! let model = set_with_cp(model, true);                 // every segment, for the profile
//! let profiler = Profiler::start(&model, &device)?;    // the counting allocator installed
//! let loss = in_phase(phase::FORWARD, || loss_of(&model, batch));
//! let grads = in_phase(phase::BACKWARD, || memsave_next::checkpoint::backward(loss));
//! let profile = profiler.finish(&model);
//! let plan = plan(&profile, budget_bytes)?;            // `BelowFloor` where nothing fits
//! let model = set_with_cp_paths(set_with_cp(model, false), &plan.paths)?;
//! ```
//!
//! The phases mark where forward and backward end (`memory::in_phase`); the recorder reads each
//! segment's forward and recomputation by itself. [`Dynamic`] keeps a budget in every step of a
//! user's own loop, at any input size (`with_cp = "dynamic"`).

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};

pub use memsave_common::planner::{
    advise, budget, dynamic, plan, solve, BelowFloor, Budget, DynamicMemory, GradientEstimate,
    IntervalFigures, ModelKeys, Plan, Profile, SegmentProfile, StepEnd, Window, WithCp,
};

use crate::checkpoint::profile as recorder;
use crate::checkpoint::{CheckpointModule, SegmentId};
use crate::{Error, Result};
use memsave_common::planner::{no_staging, Recording};

/// One step being recorded as the planner's profile ([`Profiler::start`] to
/// [`Profiler::finish`]), on the calling thread, in the current run.
#[must_use = "the recording goes on until `finish`"]
pub struct Profiler {
    recording: Option<Recording>,
}

/// The meter of `device`, or the error that says what to install.
pub(crate) fn meter(device: &Device) -> Result<Box<dyn crate::memory::Meter>> {
    crate::memory::peer_meter_for(device).ok_or_else(|| Error::Device {
        device: format!("{device:?}"),
        message: "its memory cannot be read, so a step cannot be measured: on the CPU, install \
                  memsave's counting allocator as the program's `#[global_allocator]` \
                  (`memsave_next::memory::CountingAllocator`); a GPU's pools are read on Burn \
                  0.22 from a later slice of the port"
            .to_string(),
    })
}

impl Profiler {
    /// Starts recording the step that `model` (its segments switched on as the profile wants
    /// them: every one, for a plan) runs next on `device`. Errors where the device's memory
    /// cannot be read ([`crate::memory::meter_for`]: on the CPU, the counting allocator must be
    /// installed as the program's global allocator).
    pub fn start<M: CheckpointModule>(model: &M, device: &Device) -> Result<Profiler> {
        let meter = meter(device)?;
        Ok(Profiler {
            recording: Some(Recording::begin(meter, segment_ids(model), no_staging())),
        })
    }

    /// Ends the recording: the step's profile, its segments named by their paths in the model
    /// the profiler started with, its gradients estimated from `model`'s trainable parameters
    /// where the meter cannot tell them apart.
    pub fn finish<M: Module>(mut self, model: &M) -> Profile {
        let (trainable, layout) = trainable(model);
        self.recording
            .take()
            .expect("a profiler records until it finishes")
            .end(trainable, layout)
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        // A profiler dropped without `finish` (a step that failed) leaves no recording on.
        if self.recording.take().is_some() {
            recorder::stop();
        }
    }
}

/// The trainable bytes in the optimizer's unit (four a weight, whatever the weights are kept
/// in) and the gradients' layout of `model`.
pub(crate) fn trainable<M: Module>(model: &M) -> (u64, Vec<(String, u64)>) {
    let layout = trainable_layout(model);
    let trainable = layout.iter().map(|(_, _, elements)| elements * 4).sum();
    let layout = layout
        .into_iter()
        .map(|(path, bytes, _)| (path, bytes))
        .collect();
    (trainable, layout)
}

/// The words of a user's own loop in `"dynamic"`'s advice: no config keys.
pub const OWN_LOOP_KEYS: ModelKeys = ModelKeys {
    with_cp: "the model's `with_cp` switches",
    batch: "the batch size",
    also_with_cp: &[],
};

/// `with_cp = "dynamic"` in a user's own loop on Burn 0.22: a memory budget kept in every step
/// at any input size, exactly (memsave-common's [`DynamicMemory`], the engine of memsave's
/// runner). The first step is profiled with every segment checkpointed; from then on each
/// segment chooses at its entry whether to keep its activations, from the profile nearest the
/// step's input size and the meter's reading. Gradients are the plain run's, bit for bit.
///
/// ```ignore
/// use memsave_next::memory::{in_phase, phase};
/// let mut dynamic = Dynamic::new(Budget::Fraction(0.7), &device)?;
/// let mut model = dynamic.start(model);                       // every segment switched on
/// for batch in batches {
///     dynamic.begin_step(&model);
///     let loss = in_phase(phase::FORWARD, || loss_of(&model, batch));
///     let grads = in_phase(phase::BACKWARD, || memsave_next::checkpoint::backward(loss));
///     model = optimizer.step(lr, model, GradientsParams::from_grads(grads, &model));
///     dynamic.end_step(&model, false)?;                       // the budget's figures, or why not
/// }
/// ```
///
/// The phases mark where forward and backward end (the profile's windows); a budget share
/// (`Budget::Fraction`) is of the first step's peak without checkpointing, so the first batch
/// should be the largest.
pub struct Dynamic {
    engine: DynamicMemory,
    device: Device,
    iter: usize,
    interval: usize,
    started: bool,
}

impl Dynamic {
    /// Keeps `budget` on `device`. Errors where the device's memory cannot be read.
    pub fn new(budget: Budget, device: &Device) -> Result<Self> {
        Self::with_keys(budget, OWN_LOOP_KEYS, device)
    }

    /// [`Dynamic::new`], its errors and advice naming the model's settings as `keys` says (a
    /// config's `model.backbone.with_cp`, `data.samples_per_gpu`).
    pub fn with_keys(budget: Budget, keys: ModelKeys, device: &Device) -> Result<Self> {
        let meter = meter(device)?;
        Ok(Dynamic {
            engine: DynamicMemory::new(budget, keys, meter, no_staging()),
            device: device.clone(),
            iter: 0,
            interval: 50,
            started: false,
        })
    }

    /// Says the figures of the steps every `interval` steps (an event with target `memsave`).
    pub fn with_log_interval(mut self, interval: usize) -> Self {
        self.interval = interval.max(1);
        self
    }

    /// Switches every segment of `model` on (the choice is made at each entry from now on, on
    /// this thread, in the current run).
    pub fn start<M: CheckpointModule>(&mut self, model: M) -> M {
        self.engine.start(None);
        self.started = true;
        crate::checkpoint::set_with_cp(model, true)
    }

    /// Before a step's forward on `model` (the model [`Dynamic::start`] returned, or its
    /// optimized successor).
    pub fn begin_step<M: CheckpointModule>(&mut self, model: &M) {
        let meter = crate::memory::peer_meter_for(&self.device);
        self.engine.begin_step(meter, segment_ids(model));
    }

    /// Between the two passes of a step (the step in backward with clipping or mixed
    /// precision): the second runs on `model` (tapped afresh), with the first's choices.
    pub fn first_pass_done<M: CheckpointModule>(&mut self, model: &M) {
        self.engine.first_pass_done(segment_ids(model));
    }

    /// After a step (`overflow`: the optimizer skipped it): the step's failure if it had one (its
    /// least over the budget: an error naming the input's shape and what holds the memory), else
    /// the engine's lines, said as events with target `memsave` and returned.
    pub fn end_step<M: Module>(&mut self, model: &M, overflow: bool) -> Result<Vec<String>> {
        let (trainable, layout) = trainable(model);
        let iter = self.iter;
        self.iter += 1;
        let lines = self.engine.end_step(StepEnd {
            iter,
            overflow,
            trainable_elements: trainable / 4,
            layout,
            report: (iter + 1) % self.interval == 0,
        });
        if let Some(failure) = memsave_common::run::take_failure() {
            return Err(failure);
        }
        let lines = lines?;
        for line in &lines {
            tracing::info!(target: "memsave", "{line}");
        }
        Ok(lines)
    }

    /// The figures of the run so far: steps, segments kept and recomputed, the highest step
    /// peak and the budget in bytes, per input size.
    pub fn figures(&self) -> IntervalFigures {
        self.engine.figures()
    }

    /// The profiles taken so far, and the budget in bytes.
    pub fn profiled(&self) -> (Vec<Profile>, u64) {
        self.engine.profiled()
    }
}

impl Dynamic {
    /// Ends the choosing: later segments on this thread run as their flags say (also done when
    /// it is dropped).
    pub fn end(&mut self) {
        if std::mem::take(&mut self.started) {
            self.engine.end();
        }
    }
}

impl Drop for Dynamic {
    fn drop(&mut self) {
        self.end();
    }
}

/// Each segment of `model` by identity, to its module path.
pub fn segment_ids<M: CheckpointModule>(model: &M) -> HashMap<SegmentId, String> {
    let mut ids = HashMap::new();
    model.visit_segments("", &mut |path, id| {
        ids.insert(id, path.to_string());
    });
    ids
}

/// The trainable parameters of `model` in visiting order: module path, gradient bytes (the
/// parameter's dtype) and elements.
pub fn trainable_layout<M: Module>(model: &M) -> Vec<(String, u64, u64)> {
    struct Layout {
        path: Vec<String>,
        params: Vec<(String, u64, u64)>,
    }
    impl ModuleVisitor for Layout {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_require_grad() {
                let elements = value.shape().num_elements() as u64;
                let bytes = elements * value.dtype().size() as u64;
                self.params.push((self.path.join("."), bytes, elements));
            }
        }
    }
    let mut layout = Layout {
        path: Vec::new(),
        params: Vec::new(),
    };
    model.visit(&mut layout);
    layout.params
}
