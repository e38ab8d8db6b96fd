//! Gradient checkpointing: run a segment of a model without keeping its activations, keep only
//! its input, and recompute it during backward (MMCV's `with_cp`, `torch.utils.checkpoint`).
//!
//! [`checkpoint`] is the runtime under `#[with_cp]`; it works on any backend that implements
//! [`CheckpointBackend`]: on Burn's `Autodiff` backend it records a recompute node, on a plain
//! backend (inference) it just runs the segment. Gradients reach the optimizer through the
//! ordinary path: `loss.backward()`, then `GradientsParams::from_grads(grads, &model)`.
//!
//! Beyond PyTorch: BatchNorm ([`crate::nn::BatchNorm`]) updates its running statistics once per
//! step, not twice, and dropout ([`crate::nn::Dropout`]) reuses its masks in the recomputation
//! without touching the global random stream. Burn's own random layers are replayed through a
//! reseeded stream (see [`RandomDraws`]). Float tensors cross a segment with their gradients;
//! int and bool tensors and plain numbers cross it as constants ([`Segment`]).
//!
//! After a backward pass, call [`join_helpers`] (the training hooks do) so that no recompute
//! thread outlives its step.

mod autodiff;
pub(crate) mod context;
pub(crate) mod id;
mod module;
pub mod offload;
mod segment;
mod stream;
mod threads;

use burn::backend::Flex;
use burn::module::Module;
use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;

#[cfg(feature = "cubecl")]
pub use crate::memory::cube::copy_stream;
pub(crate) use autodiff::{mark_ours, take_grad};
pub use context::{is_recomputing, random};
pub use id::SegmentId;
pub use memsave_common::checkpoint::{
    dynamic, no_segment_message, profile, reached, set_unused_with_cp, unreached, unused_with_cp,
    UnusedWithCp,
};
pub use module::{segment_paths, set_with_cp, set_with_cp_paths, CheckpointModule, HasWithCp};
pub use offload::{
    activation_offload, measure_link, offload_stats, reset_offload_stats, set_activation_offload,
    wait_for_copies, ActivationOffload, Link, OffloadStats,
};
pub use segment::{floats, Segment};
pub use stream::RandomDraws;
pub use threads::{live_helpers, recomputations};

/// Ends a backward pass's part of checkpointing: waits for the helper threads of the calling
/// training thread to end, lets go the prefetches activation offload held for it, and returns
/// the step's failure, if any (a segment's input the host could not take within its limit, a
/// copy back that failed: [`crate::Error`]s naming the segment, recorded in the current run).
/// Call it after `backward()` returned (the training hooks do); never from inside a backward
/// pass, whose lock the helpers wait for. In a user's own loop: `join_helpers()?` after each
/// `backward()`.
pub fn join_helpers() -> crate::Result<()> {
    threads::join_mine();
    offload::release_retained(true);
    match crate::run::take_failure() {
        Some(error) => {
            offload::abandon();
            Err(error)
        }
        None => Ok(()),
    }
}

/// The failure recorded in the current run for the calling training thread's step, if any,
/// taken; its offloaded segments are let go. What a runner asks after a forward: a failure
/// there (the host past its limit) ends the step before its backward.
pub(crate) fn take_step_failure() -> Option<crate::Error> {
    let failure = crate::run::take_failure()?;
    offload::abandon();
    Some(failure)
}

/// After a step that ended early (a failure or a panic): what activation offload held for the
/// calling training thread is let go, and its recorded failure dropped.
pub(crate) fn abandon_step() {
    offload::abandon();
    let _ = crate::run::take_failure();
}

/// What the macros generate code against. Not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use super::module::join_path;
    pub use super::stream::__private::*;
    pub use memsave_common::checkpoint::__private::FieldsOf;
}

/// A backend on which memsave can checkpoint segments. In generic model code, bound the backend
/// with `B: memsave::Backend` (this trait) where a `#[with_cp]` method is defined or called.
#[diagnostic::on_unimplemented(
    message = "memsave cannot checkpoint segments on the backend `{Self}`",
    label = "a `#[with_cp]` method needs a checkpointing backend",
    note = "in generic code, bound the backend with `{Self}: memsave::Backend` (Burn's `Backend` \
            plus checkpointing) instead of `{Self}: Backend`",
    note = "memsave supports `Flex`, the CubeCL backends (`Cuda`, `Wgpu`: features `cuda`, `wgpu`) and `Autodiff` over any of them"
)]
pub trait CheckpointBackend: Backend {
    /// Whether `tensor` is recorded in an autodiff graph: a leaf that requires grad or a result
    /// of one (PyTorch's `requires_grad`; Burn's `is_require_grad` is true for leaves only).
    fn is_tracked(tensor: &FloatTensor<Self>) -> bool;

    /// Runs `segment(module, input)`; on an autodiff backend, keeps only `input` and recomputes
    /// the segment in backward. `method` names the segment in warnings. `stream`: the seed the
    /// backend's random stream was given before this call, to give it again before the
    /// recomputation (see [`RandomDraws`]). `stage`: its inputs wait in host memory whatever the
    /// run's activation offload setting says (`with_cp = "dynamic"` chose it). Use
    /// [`checkpoint`], which also applies MMCV's guard.
    fn checkpoint_segment<M, I, O, F>(
        method: &'static str,
        module: &M,
        input: I,
        segment: F,
        stream: Option<u64>,
        stage: bool,
    ) -> O
    where
        M: Module<Self> + 'static,
        I: Segment<Self>,
        O: Segment<Self>,
        F: Fn(&M, I) -> O + Send + Sync + 'static;
}

/// Runs `segment(module, input)` as a checkpointed segment when `input` requires grad (MMCV's
/// guard), else as written.
///
/// The rules (the same as `torch.utils.checkpoint`'s, with one more):
/// - the segment must be deterministic given its input and the module: it runs twice. Random
///   draws through [`random`] (memsave's `Dropout`) are replayed; for a segment whose Burn layers
///   draw from the backend's stream (Burn's `Dropout` inside `MultiHeadAttention`, say), use
///   [`checkpoint_with`] and [`Options::random`] (`#[with_cp]` does so by itself when its module
///   [draws](RandomDraws));
/// - every tracked tensor it uses must come in as its input or as a parameter (`Param`) of
///   `module`. One captured by the closure, or held in a bare `Tensor` field, cannot be
///   recomputed from fresh leaves: memsave sees it (an output of the untracked first forward is
///   tracked), runs that segment plainly (nothing saved, gradients exact) and warns once,
///   naming it. Pass such a tensor as an input instead.
pub fn checkpoint<B, M, I, O, F>(module: &M, input: I, segment: F) -> O
where
    B: CheckpointBackend,
    M: Module<B> + 'static,
    I: Segment<B>,
    O: Segment<B>,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    checkpoint_with(Options::new(), module, input, segment)
}

/// How [`checkpoint_with`] runs a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// The method it is, which names the segment `Type::method` in warnings (`""`: none).
    pub method: &'static str,
    /// Whether it is checkpointed (when its input requires grad); off, it runs as written.
    pub enabled: bool,
    /// Whether its layers draw from the backend's global random stream (Burn's `Dropout`, or a
    /// layer holding one, such as `MultiHeadAttention`): it then runs under a stream of its
    /// own, seeded from the global one, checkpointed or not, and its recomputation draws the
    /// same values (see [`RandomDraws`]).
    pub random: bool,
}

impl Options {
    /// Checkpointed, unnamed, drawing nothing from the global stream: [`checkpoint`]'s.
    pub const fn new() -> Self {
        Options {
            method: "",
            enabled: true,
            random: false,
        }
    }

    /// Named after the method `method`.
    pub const fn method(self, method: &'static str) -> Self {
        Options { method, ..self }
    }

    /// Checkpointed when `on` (a `#[with_cp]` method passes its module's flag).
    pub const fn enabled(self, on: bool) -> Self {
        Options {
            enabled: on,
            ..self
        }
    }

    /// Under a random stream of its own when `draws` (`#[with_cp]` passes whether its module
    /// [draws](RandomDraws)).
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

/// [`checkpoint`] as `options` say: the one entry point of segments (the body of every
/// `#[with_cp]` method is a call to it). A segment whose layers draw from the backend's stream
/// takes `Options::new().random(true)`.
pub fn checkpoint_with<B, M, I, O, F>(options: Options, module: &M, input: I, segment: F) -> O
where
    B: CheckpointBackend,
    M: Module<B> + 'static,
    I: Segment<B>,
    O: Segment<B>,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    let Options {
        method,
        enabled: with_cp,
        random: draws,
    } = options;
    let floats = floats(&input);
    // A stream of its own, in training only (Burn's random layers draw only then).
    let stream = match floats.first() {
        Some(first) if draws => {
            let device = B::float_device(first);
            B::ad_enabled(&device).then(|| {
                let seed = stream::draw_seed::<B>(&device);
                B::seed(&device, seed);
                seed
            })
        }
        _ => None,
    };
    memsave_common::checkpoint::note(SegmentId::of(module));
    // A thread under `with_cp = "dynamic"` chooses per entry (see [`dynamic`]).
    let choice =
        if with_cp && !context::is_recomputing_segment() && floats.iter().any(B::is_tracked) {
            let chosen = dynamic::choose(SegmentId::of(module), || {
                let shape = floats
                    .first()
                    .map(|f| burn::tensor::TensorMetadata::shape(f).to_vec())
                    .unwrap_or_default();
                let bytes = floats
                    .iter()
                    .map(|f| {
                        (burn::tensor::TensorMetadata::shape(f).num_elements()
                            * burn::tensor::TensorMetadata::dtype(f).size())
                            as u64
                    })
                    .sum();
                (shape, bytes)
            });
            Some(chosen.unwrap_or(dynamic::Choice::Recompute))
        } else {
            None
        };
    let checkpointed = choice.is_some_and(|c| c != dynamic::Choice::Keep);
    // Staged where chosen; elsewhere as the run's activation offload setting says.
    let stage = choice == Some(dynamic::Choice::Offload);
    let device = floats.first().map(|first| B::float_device(first));
    let sync = || {
        if let Some(device) = &device {
            let _ = B::sync(device);
        }
    };
    profile::forward(SegmentId::of(module), checkpointed, sync, || {
        if checkpointed {
            B::checkpoint_segment(method, module, input, segment, stream, stage)
        } else {
            segment(module, input)
        }
    })
}

/// The segments of the current run that ran without checkpointing because a tracked tensor
/// entered them other than as an input or a parameter (see [`checkpoint`]), by name, in the
/// order first seen.
pub fn uncheckpointed_segments() -> Vec<String> {
    lock_uncheckpointed(&crate::run::current().part()).clone()
}

/// [`uncheckpointed_segments`], a part of the run's state.
#[derive(Default)]
struct Uncheckpointed(std::sync::Mutex<Vec<String>>);

fn lock_uncheckpointed(part: &Uncheckpointed) -> std::sync::MutexGuard<'_, Vec<String>> {
    part.0
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Warns, once per segment and run, that the segment `method` of a module of type `module`
/// runs without checkpointing.
pub(crate) fn warn_uncheckpointed(module: &str, method: &str) {
    let name = id::segment_name(module, method);
    let part = crate::run::current().part::<Uncheckpointed>();
    let mut seen = lock_uncheckpointed(&part);
    if seen.contains(&name) {
        return;
    }
    tracing::warn!(
        target: "memsave",
        segment = %name,
        "the checkpointed segment `{name}` uses a tracked tensor that is neither its input nor \
         a parameter (captured by its closure, or held in a bare `Tensor` field); it runs \
         without checkpointing. Pass that tensor to the segment as an input, or hold it in a \
         `Param`, to checkpoint it."
    );
    seen.push(name);
}

/// Without autodiff there is nothing to keep: the segment just runs.
macro_rules! plain_backend {
    ([$($generics:tt)*] $backend:ty) => {
        impl<$($generics)*> CheckpointBackend for $backend {
            fn is_tracked(_tensor: &FloatTensor<Self>) -> bool {
                false
            }

            fn checkpoint_segment<M, I, O, F>(
                _name: &'static str,
                module: &M,
                input: I,
                segment: F,
                _stream: Option<u64>,
                _stage: bool,
            ) -> O
            where
                M: Module<Self> + 'static,
                I: Segment<Self>,
                O: Segment<Self>,
                F: Fn(&M, I) -> O + Send + Sync + 'static,
            {
                segment(module, input)
            }
        }
    };
}

plain_backend!([] Flex);
#[cfg(feature = "cubecl")]
plain_backend!(
    [R: burn_cubecl::CubeRuntime, FE: burn_cubecl::FloatElement, IE: burn_cubecl::IntElement, BE: burn_cubecl::BoolElement]
    burn_cubecl::CubeBackend<R, FE, IE, BE>
);
#[cfg(feature = "fusion")]
plain_backend!([FB: burn_fusion::FusionBackend] burn_fusion::Fusion<FB>);
