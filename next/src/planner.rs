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
//! segment's forward and recomputation by itself.

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};

pub use memsave_common::planner::{
    advise, budget, plan, solve, BelowFloor, Budget, GradientEstimate, ModelKeys, Plan, Profile,
    SegmentProfile, Window, WithCp,
};

use crate::checkpoint::profile::{self as recorder, Boundary};
use crate::checkpoint::{CheckpointModule, SegmentId};
use crate::{Error, Result};

/// One step being recorded as the planner's profile ([`Profiler::start`] to
/// [`Profiler::finish`]), on the calling thread, in the current run.
#[must_use = "the recording goes on until `finish`"]
pub struct Profiler {
    ids: HashMap<SegmentId, String>,
}

impl Profiler {
    /// Starts recording the step that `model` (its segments switched on as the profile wants
    /// them: every one, for a plan) runs next on `device`. Errors where the device's memory
    /// cannot be read ([`crate::memory::meter_for`]: on the CPU, the counting allocator must be
    /// installed as the program's global allocator).
    pub fn start<M: CheckpointModule>(model: &M, device: &Device) -> Result<Profiler> {
        let meter = crate::memory::meter_for(device).ok_or_else(|| Error::Device {
            device: format!("{device:?}"),
            message: "its memory cannot be read, so a step cannot be profiled: on the CPU, \
                      install memsave's counting allocator as the program's \
                      `#[global_allocator]` (`memsave_next::memory::CountingAllocator`); a GPU's \
                      pools are read on Burn 0.22 from a later slice of the port"
                .to_string(),
        })?;
        let profiler = Profiler {
            ids: segment_ids(model),
        };
        recorder::start(meter);
        recorder::boundary(Boundary::Start);
        Ok(profiler)
    }

    /// Ends the recording: the step's profile, its segments named by their paths in `model`
    /// (the model whose forward ran), its gradients estimated from `model`'s trainable
    /// parameters where the meter cannot tell them apart.
    pub fn finish<M: Module>(self, model: &M) -> Profile {
        recorder::boundary(Boundary::End);
        let events = recorder::stop();
        let layout = trainable_layout(model);
        // The optimizer's unit: four bytes a weight, whatever the weights are kept in.
        let trainable = layout.iter().map(|(_, _, elements)| elements * 4).sum();
        let estimate = GradientEstimate::new(
            layout
                .into_iter()
                .map(|(path, bytes, _)| (path, bytes))
                .collect(),
        );
        Profile::from_events(&events, &self.ids, trainable, &estimate)
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        // A profiler dropped without `finish` (a step that failed) leaves no recording on.
        if recorder::is_recording() {
            recorder::stop();
        }
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
