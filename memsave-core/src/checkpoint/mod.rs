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
pub mod offload;
pub mod profile;
mod reached;
mod segment;
mod stream;
mod threads;

use burn::backend::Flex;
use burn::module::Module;
use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;

pub(crate) use autodiff::{mark_ours, take_grad};
pub use context::{is_recomputing, random};
pub use id::SegmentId;
pub use offload::{
    activation_offload, measure_link, offload_stats, reset_offload_stats, set_activation_offload,
    wait_for_copies, ActivationOffload, Link, OffloadStats,
};
pub use reached::{no_segment_message, reached, unreached};
pub use segment::{floats, Segment};
pub use stream::RandomDraws;
#[cfg(feature = "cubecl")]
pub use threads::copy_stream;
#[cfg(feature = "cubecl")]
pub(crate) use threads::copy_stream_in_use;
pub use threads::{join_helpers, live_helpers, recomputations};

/// What the macros generate code against. Not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use super::join_path;
    pub use super::stream::__private::*;

    /// The fields of a `#[memsave::model]` type `M` without a `with_cp` flag or a marked field:
    /// the type its "no field marked" bound is on, so that the compiler reports that bound's
    /// message (it names the fields) rather than `CheckpointModule`'s.
    pub struct FieldsOf<M>(core::marker::PhantomData<M>);
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
    /// recomputation (see [`RandomDraws`]). Use [`checkpoint`], which also applies MMCV's guard.
    fn checkpoint_segment<M, I, O, F>(
        method: &'static str,
        module: &M,
        input: I,
        segment: F,
        stream: Option<u64>,
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
    reached::note(SegmentId::of(module));
    let checkpointed = with_cp && floats.iter().any(B::is_tracked);
    let device = floats.first().map(|first| B::float_device(first));
    let sync = || {
        if let Some(device) = &device {
            let _ = B::sync(device);
        }
    };
    profile::forward(SegmentId::of(module), checkpointed, sync, || {
        if checkpointed {
            B::checkpoint_segment(method, module, input, segment, stream)
        } else {
            segment(module, input)
        }
    })
}

/// The segments that ran without checkpointing because a tracked tensor entered them other
/// than as an input or a parameter (see [`checkpoint`]), by name, in the order first seen.
pub fn uncheckpointed_segments() -> Vec<String> {
    lock_uncheckpointed().clone()
}

static UNCHECKPOINTED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn lock_uncheckpointed() -> std::sync::MutexGuard<'static, Vec<String>> {
    UNCHECKPOINTED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Warns, once per segment, that the segment `method` of a module of type `module` runs
/// without checkpointing.
pub(crate) fn warn_uncheckpointed(module: &str, method: &str) {
    let name = id::segment_name(module, method);
    let mut seen = lock_uncheckpointed();
    if seen.contains(&name) {
        return;
    }
    eprintln!(
        "memsave: warning: the checkpointed segment `{name}` uses a tracked tensor that is \
         neither its input nor a parameter (captured by its closure, or held in a bare `Tensor` \
         field); it runs without checkpointing. Pass that tensor to the segment as an input, or \
         hold it in a `Param`, to checkpoint it."
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

/// A module with a `with_cp` flag, read by `#[with_cp]` methods.
///
/// `#[memsave::model]` implements it for a struct with a field `with_cp: bool`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no `with_cp` flag, so `#[with_cp]` cannot be used on its methods",
    label = "this method reads `self.with_cp`",
    note = "put `#[memsave::model]` on the struct and give it a field `with_cp: bool` (start it \
            at `false`; `set_with_cp` or the config switches it on)"
)]
pub trait HasWithCp {
    /// The module's own flag.
    fn with_cp(&self) -> bool;
}

/// A module in which checkpointing can be switched on: it has a `with_cp` flag, or fields
/// marked `#[with_cp]` that lead to one.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be checkpointed: nothing in it has a `with_cp` switch",
    label = "checkpointing is switched on in this `{Self}`",
    note = "a checkpointable block is a `#[memsave::model]` struct with a field `with_cp: bool` \
            and a `#[with_cp]` method (its forward), and a model reaches its blocks through \
            fields marked `#[with_cp]`; Burn's layers have no such switch: checkpoint the block \
            that contains them"
)]
pub trait CheckpointModule: Sized {
    /// Whether the module is itself a checkpointed segment ([`crate::fp16::__private::Marked`]:
    /// it has the `with_cp` flag, or it is an enum of blocks) or only leads to some
    /// ([`crate::fp16::__private::Unmarked`]: a container, such as a backbone whose stem runs
    /// plainly). The first-layer guard of `#[auto_fp16]` asks it of the field that receives the
    /// network's input.
    type Mark: Default;

    /// Sets every `with_cp` flag of this module and of its `#[with_cp]` fields to `on`.
    fn set_with_cp(self, on: bool) -> Self;

    /// Sets the `with_cp` flag of each segment below this module to `on(its path)`, where the
    /// path of this module is `path` and a marked field's is `path.field` (`Vec` items by
    /// index: `backbone.layer2.1`; an enum's variant adds nothing). See [`set_with_cp_paths`].
    fn set_with_cp_by_path(self, _path: &str, _on: &dyn Fn(&str) -> bool) -> Self {
        self
    }

    /// Calls `visit` with the path and identity of each segment (a module with a `with_cp`
    /// flag) at or below this module, reached through `#[with_cp]` fields, in field order.
    fn visit_segments(&self, _path: &str, _visit: &mut dyn FnMut(&str, SegmentId)) {}
}

/// The module paths of the segments of `model` (`backbone.layer1.0`, ...), in field order.
pub fn segment_paths<M: CheckpointModule>(model: &M) -> Vec<String> {
    let mut paths = Vec::new();
    model.visit_segments("", &mut |path, _| paths.push(path.to_string()));
    paths
}

/// Checkpoints exactly the segments of `model` whose paths are in `paths` (as
/// [`segment_paths`] names them), and no other: a plan pinned by hand, or the planner's.
/// A path that names no segment is an error that lists the closest ones.
pub fn set_with_cp_paths<M: CheckpointModule>(model: M, paths: &[String]) -> crate::Result<M> {
    let known = segment_paths(&model);
    for path in paths {
        if !known.contains(path) {
            let mut close: Vec<&String> = known
                .iter()
                .filter(|known| {
                    known.starts_with(path.as_str()) || path.starts_with(known.as_str())
                })
                .take(6)
                .collect();
            if close.is_empty() {
                close = known.iter().take(6).collect();
            }
            let close: Vec<String> = close.iter().map(|p| format!("`{p}`")).collect();
            return Err(crate::Error::invalid(
                "with_cp",
                format!(
                    "`{path}` is not a checkpointable segment of this model; its {} segments \
                     include {}",
                    known.len(),
                    if close.is_empty() {
                        "none".to_string()
                    } else {
                        close.join(", ")
                    }
                ),
            ));
        }
    }
    Ok(model.set_with_cp_by_path("", &|path| paths.iter().any(|p| p == path)))
}

/// Switches checkpointing on (or off) in `model`: its `with_cp` flag and, through every field
/// marked `#[with_cp]`, the flags of the blocks below (MMCV's `with_cp=True` on a backbone).
pub fn set_with_cp<M: CheckpointModule>(model: M, on: bool) -> M {
    model.set_with_cp(on)
}

impl<T: CheckpointModule> CheckpointModule for Vec<T> {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        self.into_iter()
            .map(|module| module.set_with_cp(on))
            .collect()
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        self.into_iter()
            .enumerate()
            .map(|(index, module)| module.set_with_cp_by_path(&join_index(path, index), on))
            .collect()
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        for (index, module) in self.iter().enumerate() {
            module.visit_segments(&join_index(path, index), visit);
        }
    }
}

impl<T: CheckpointModule> CheckpointModule for Option<T> {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        self.map(|module| module.set_with_cp(on))
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        self.map(|module| module.set_with_cp_by_path(path, on))
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        if let Some(module) = self {
            module.visit_segments(path, visit);
        }
    }
}

impl<T: CheckpointModule> CheckpointModule for Box<T> {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        Box::new((*self).set_with_cp(on))
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        Box::new((*self).set_with_cp_by_path(path, on))
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        (**self).visit_segments(path, visit);
    }
}

impl<T: CheckpointModule, const N: usize> CheckpointModule for [T; N] {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        self.map(|module| module.set_with_cp(on))
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        let mut index = 0;
        self.map(|module| {
            index += 1;
            module.set_with_cp_by_path(&join_index(path, index - 1), on)
        })
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        for (index, module) in self.iter().enumerate() {
            module.visit_segments(&join_index(path, index), visit);
        }
    }
}

/// `path.name`, or `name` at the root.
#[doc(hidden)]
pub fn join_path(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_string()
    } else {
        format!("{path}.{name}")
    }
}

fn join_index(path: &str, index: usize) -> String {
    join_path(path, &index.to_string())
}
