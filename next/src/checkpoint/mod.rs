//! Gradient checkpointing on Burn 0.22: run a segment of a model without keeping its
//! activations, keep only its input, and recompute it during backward (MMCV's `with_cp`,
//! `torch.utils.checkpoint`). The port of `memsave-core`'s `checkpoint` (Burn 0.21).
//!
//! Forward: the segment runs once (twice where a tracked tensor enters it other than as its
//! input or a parameter: it then runs plainly, said once), untracked (the module's parameters with `no_grad()`, which
//! keeps Burn's training flags, so dropout and BatchNorm behave as in training; the inputs
//! fresh untracked leaves on their autodiff device). In the outer graph it becomes:
//!
//! ```text
//!   input_0  input_1  param_0 ...        tracked inputs and parameters
//!        \     |     /
//!         join nodes                     (pairwise; no step of their own)
//!              |
//!            anchor                      recomputes the segment in its step
//!           /     \
//!      output_0  output_1                hand their gradients to the anchor
//! ```
//!
//! Backward: Burn runs steps by descending depth, so every output node's step runs before the
//! anchor's. The anchor recomputes the segment from fresh leaves (the kept inputs, and copies
//! of the parameters) in a graph of its own, runs its backward there (Burn 0.22.1 allows a
//! backward inside a step, the graphs sharing no node) with each output's gradient as the seed,
//! and registers the gradients by node id: the inputs' on the inputs' nodes, the parameters' on
//! the original parameters' nodes, so `GradientsParams::from_grads(grads, &model)` finds them as
//! for any other parameter.
//!
//! "No gradient" stays none where plain Burn gives none: a parameter or a leaf input the
//! recomputation does not reach gets nothing. A tracked non-leaf input made by Burn's ops gets
//! zeros (its step consumes a gradient and would panic on none), its true value; an input that
//! is another segment's output gets a mark that its node reads as none ([`nodes::no_gradient`]).
//!
//! Both of Burn's checkpointing strategies (`Device::autodiff()` and
//! `.gradient_checkpointing()`): the nodes are compute-bound, which Burn's Balanced strategy
//! keeps rather than recomputes.
//!
//! Burn's own layers inside a segment behave as without checkpointing: a `Dropout`'s draws are
//! replayed in the recomputation from a seed of the segment's own, and a `BatchNorm`'s running
//! statistics are updated once per step (`state.rs`).
//!
//! Each segment reaches the run it trains in (memsave-common's `RunContext`, shared with
//! memsave on Burn 0.21): its `#[with_cp]` type is noted there (the check of the switches), the
//! planner's recorder measures its forward and recomputation when a recording is on
//! ([`profile`]), and a thread under `with_cp = "dynamic"` chooses at its entry whether it keeps
//! its activations or recomputes them ([`dynamic`]). Not here yet (the port's next slices): CPU
//! staging of the kept inputs.

pub(crate) mod nodes;
mod op;
pub(crate) mod ours;
mod segment;
pub(crate) mod state;
mod wrapped;

use std::marker::PhantomData;

use burn::backend::{Dispatch, DispatchAutodiffContext, TensorMetadata};
use burn::module::Module;
use burn::tensor::Tensor;

use crate::backend;
use op::Checkpoint;
pub use op::{is_recomputing, uncheckpointed_segments};

#[doc(hidden)]
pub use memsave_common::checkpoint::__private;
pub use memsave_common::checkpoint::{
    dynamic, profile, reached, set_unused_with_cp, unreached, unused_with_cp,
};
pub use memsave_common::checkpoint::{no_segment_message, UnusedWithCp};
pub use memsave_common::checkpoint::{
    segment_paths, set_with_cp, set_with_cp_paths, CheckpointModule, HasWithCp, SegmentId,
    UnknownSegment,
};
pub use segment::{floats, Segment};
pub use wrapped::Checkpointed;

/// `loss.backward()`, leaving the device's random stream where a run without checkpointing
/// leaves it. A recomputation replays its segment's draws by giving the device the segment's
/// seed again, which moves the stream (Burn has one per device and no way to read its state):
/// without this, the steps after a checkpointed one would draw other dropout masks than the same
/// run without checkpointing (each step's gradients exact, the run's not). The stream's next
/// seed is drawn before the backward and given back after it, with or without checkpointing.
/// memsave's `MixedPrecision::backward` and burn-train adapter call it; a user's own loop with
/// segments that draw calls it instead of `loss.backward()`.
pub fn backward<const D: usize>(loss: Tensor<D>) -> burn::tensor::Gradients {
    let device = loss.device();
    let next = state::draw_seed(&device);
    let grads = loss.backward();
    device.seed(next);
    grads
}

/// Runs `segment(module, input)` as a checkpointed segment when a float tensor of `input` is
/// tracked (MMCV's guard: `x.requires_grad`), else as written: [`checkpoint_with`] with the
/// default [`Options`].
///
/// The rules (`torch.utils.checkpoint`'s): the segment must be deterministic given its input,
/// the module and the backend's random stream, since it runs twice; tensors must enter it as its
/// input or as the module's parameters (a tracked tensor captured otherwise cannot be recomputed
/// from fresh leaves: such a segment runs plainly, with a warning naming it).
pub fn checkpoint<M, I, O, F>(module: &M, input: I, segment: F) -> O
where
    M: Module + 'static,
    I: Segment,
    O: Segment,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    checkpoint_with(Options::new(), module, input, segment)
}

/// How [`checkpoint_with`] runs a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// The segment's name in messages (`#[with_cp]` passes its method's): `""` names it by its
    /// module's type alone.
    pub method: &'static str,
    /// Whether to checkpoint at all (a model's `with_cp` switch); off, the segment runs as
    /// written, under its own random stream all the same.
    pub enabled: bool,
    /// Whether the module draws from the backend's random stream where its layers do not tell (a
    /// layer of the user's own that calls `Tensor::random` and has no training switch). Burn's
    /// random layers are found from the module whatever this says.
    pub random: bool,
}

impl Options {
    /// Checkpointed, the module's random draws found from its layers.
    pub const fn new() -> Self {
        Options {
            method: "",
            enabled: true,
            random: false,
        }
    }

    /// Names the segment in messages: the method it runs.
    pub const fn method(self, method: &'static str) -> Self {
        Options { method, ..self }
    }

    /// Checkpointed only when `enabled` (the model's `with_cp` switch).
    pub const fn enabled(self, enabled: bool) -> Self {
        Options { enabled, ..self }
    }

    /// Says that the module draws from the backend's random stream where its layers do not
    /// tell (a layer of the user's own that calls `Tensor::random` and has no training switch).
    pub const fn random(self, draws: bool) -> Self {
        Options {
            random: draws,
            ..self
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Self::new()
    }
}

/// [`checkpoint`] as `options` say: the one entry point of segments.
///
/// A segment whose module draws from the backend's random stream (Burn's `Dropout`,
/// `GaussianNoise` and `RRelu`, or [`Options::random`]) runs under a stream of its own
/// (a seed drawn from the global stream, given to the device), checkpointed or not, and its
/// recomputation replays the same draws: the gradients equal the run without checkpointing's,
/// bit for bit. A module's running statistics (Burn's `BatchNorm`) are updated once per step.
pub fn checkpoint_with<M, I, O, F>(options: Options, module: &M, input: I, segment: F) -> O
where
    M: Module + 'static,
    I: Segment,
    O: Segment,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    let id = SegmentId::of(module);
    if !options.method.is_empty() {
        memsave_common::checkpoint::note(id);
    }
    let floats = floats(&input);
    if let Some(unsupported) = floats
        .iter()
        .find_map(|tensor| backend::supported(tensor).err())
    {
        // Said once per process: which backends memsave has ops for is the build's.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                target: "memsave",
                "{unsupported}: checkpointed segments (`{}` first) run without checkpointing",
                std::any::type_name::<M>()
            )
        });
        return segment(module, input);
    }
    // In training only (Burn's layers draw and update statistics only on an autodiff device):
    // the parameters initialized at a fixed point, and a stream of its own where the layers draw.
    let training = floats
        .first()
        .filter(|first| matches!(first.autodiff, DispatchAutodiffContext::Enabled(_)));
    if training.is_some() {
        state::initialize(module);
    }
    let own_stream = training.and_then(|first| {
        let draws = options.random || state::draws_random(module);
        draws.then(|| {
            let device = state::device_of(first);
            let seed = state::seed_own_stream(&device);
            (device, seed)
        })
    });
    let tracked = floats
        .iter()
        .find(|tensor| backend::is_tracked(tensor))
        .cloned();
    let device = floats.first().map(state::device_of);
    let sync = || {
        if let Some(device) = &device {
            // A failed device reports at its next op, where the error has a user.
            let _ = <Dispatch as burn::backend::Backend>::sync(device);
        }
    };
    let (Some(first), true) = (tracked, options.enabled) else {
        return profile::forward(id, false, sync, || segment(module, input));
    };
    // A thread under `with_cp = "dynamic"` chooses at each entry (never in a recomputation,
    // which repeats the forward as it ran).
    let choice = if !is_recomputing() {
        dynamic::choose(id, || {
            let shape = first.shape().to_vec();
            let bytes = floats
                .iter()
                .map(|f| (f.shape().num_elements() * f.dtype().size()) as u64)
                .sum();
            (shape, bytes)
        })
    } else {
        None
    };
    let checkpointed = match choice {
        Some(dynamic::Choice::Keep) => false,
        Some(dynamic::Choice::Offload) => {
            // CPU staging comes to Burn 0.22 with a later slice of the port: the segment keeps
            // its input on the device, recomputed all the same (what it saves is the same).
            // Said once per run (the run's choice, not the build's).
            if memsave_common::run::current().first_time("next: offload chosen") {
                tracing::warn!(
                    target: "memsave",
                    "CPU staging of a segment's input is not on Burn 0.22 yet: segments chosen for \
                     it keep their input on the device and are recomputed"
                );
            }
            true
        }
        Some(dynamic::Choice::Recompute) | None => true,
    };
    profile::forward(id, checkpointed, sync, || {
        if !checkpointed {
            return segment(module, input);
        }
        let op = Checkpoint {
            module,
            id,
            input,
            segment,
            own_stream,
            method: options.method,
            output: PhantomData::<O>,
        };
        backend::on_backend(&first, op).expect("the backend was checked")
    })
}
