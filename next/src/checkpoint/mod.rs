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
pub(crate) mod ours;
mod segment;
pub(crate) mod state;

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Dispatch, DispatchAutodiffContext, DispatchDevice, DispatchTensor, TensorMetadata,
};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{FloatDType, GradientCheckpointingStrategy, Shape, Tensor};

use crate::backend::{self, AdTensor, DispatchBackend, OnBackend};

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
    let choice = if RECOMPUTING.with(Cell::get) == 0 {
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

thread_local! {
    /// How many recomputations run on this thread now (they nest).
    static RECOMPUTING: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread is recomputing a checkpointed segment in backward.
pub fn is_recomputing() -> bool {
    RECOMPUTING.with(Cell::get) > 0
}

/// The segments of the current run that ran without checkpointing because a tracked tensor
/// entered them other than as an input or a parameter (see [`checkpoint`]), by name, in the order
/// first seen.
pub fn uncheckpointed_segments() -> Vec<String> {
    nodes::lock(&memsave_common::run::current().part::<Uncheckpointed>().0).clone()
}

/// [`uncheckpointed_segments`], a part of the run's state.
#[derive(Default)]
struct Uncheckpointed(Mutex<Vec<String>>);

struct Checkpoint<'a, M, I, O, F> {
    module: &'a M,
    /// The module as the model holds it: the recomputation runs a clone.
    id: SegmentId,
    input: I,
    segment: F,
    /// The segment's own random stream: its device and seed.
    own_stream: Option<(DispatchDevice, u64)>,
    method: &'static str,
    output: PhantomData<O>,
}

impl<M, I, O, F> OnBackend for Checkpoint<'_, M, I, O, F>
where
    M: Module + 'static,
    I: Segment,
    O: Segment,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    type Output = O;

    fn run<B: DispatchBackend>(self, strategy: Option<GradientCheckpointingStrategy>) -> O {
        let strategy = strategy.expect("a tracked tensor is on an autodiff device");
        match strategy {
            GradientCheckpointingStrategy::Balanced => {
                checkpoint_on::<B, BalancedCheckpointing, M, I, O, F>(self, strategy)
            }
            GradientCheckpointingStrategy::Disabled => {
                checkpoint_on::<B, NoCheckpointing, M, I, O, F>(self, strategy)
            }
        }
    }
}

/// A tracked input of the segment, as the recomputation needs it.
struct TrackedInput {
    id: NodeId,
    /// A leaf that requires grad (no step: "none" is no gradient).
    leaf: bool,
    /// Another segment's output.
    ours: bool,
    shape: Shape,
    dtype: FloatDType,
}

/// A fresh untracked leaf with `tensor`'s value, on its device (autodiff kept where it is on, so
/// Burn's layers behave as in training).
fn untracked<B: DispatchBackend>(tensor: DispatchTensor) -> DispatchTensor {
    match tensor.autodiff {
        DispatchAutodiffContext::Enabled(strategy) if backend::is_autodiff_float(&tensor) => {
            let value = B::autodiff_of(tensor).into_primitive();
            B::from_autodiff(AdTensor::<B>::new(value), strategy)
        }
        _ => tensor,
    }
}

/// Negative zeros of `shape`: a zero gradient that adds to any other without changing a bit
/// (x + -0 = x).
fn zeros<B: DispatchBackend>(
    shape: &Shape,
    device: &B::Device,
    dtype: FloatDType,
) -> FloatTensor<B> {
    B::float_neg(B::float_zeros(shape.clone(), device, dtype))
}

fn checkpoint_on<B, C, M, I, O, F>(
    op: Checkpoint<'_, M, I, O, F>,
    strategy: GradientCheckpointingStrategy,
) -> O
where
    B: DispatchBackend,
    C: CheckpointStrategy,
    M: Module + 'static,
    I: Segment,
    O: Segment,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    let Checkpoint {
        module,
        id,
        input,
        segment,
        own_stream,
        method,
        ..
    } = op;
    let running = state::Running::save(module);
    let untracked_module = module.clone().no_grad();
    let untracked_input = input.clone().map_floats(&mut untracked::<B>);
    let output = segment(&untracked_module, untracked_input);
    drop(untracked_module);

    if floats(&output).iter().any(backend::is_tracked) {
        // A tracked tensor entered other than as an input or a parameter: recomputing from fresh
        // leaves would miss its gradient. Run plainly, as the untracked forward did: the same
        // draws, the running statistics as they were before it.
        warn_once(std::any::type_name::<M>(), method);
        if let Some(running) = running {
            running.restore(module);
        }
        if let Some((device, seed)) = &own_stream {
            state::reseed(device, *seed);
        }
        return segment(module, input);
    }
    drop(running);
    if floats(&output).is_empty() {
        return output;
    }

    // The nodes the recomputation's gradients go to.
    let mut inputs = Vec::new();
    let mut parents = Vec::new();
    for tensor in floats(&input) {
        if !backend::is_tracked(&tensor) {
            inputs.push(None);
            continue;
        }
        let tensor = B::autodiff_of(tensor);
        inputs.push(Some(TrackedInput {
            id: tensor.id(),
            leaf: Autodiff::<B, C>::float_is_require_grad(&tensor),
            ours: ours::contains(tensor.id()),
            shape: tensor.shape(),
            dtype: tensor.dtype().into(),
        }));
        parents.push(tensor);
    }
    let mut params = TrackedParams::<B>(Vec::new());
    module.visit(&mut params);
    parents.extend(params.0);

    let count = floats(&output).len();
    let stash: nodes::Stash<B> = Arc::new(Mutex::new(vec![None; count]));
    let module = module.clone();
    let device = parents[0].primitive().device();
    let run: nodes::Run<B> = Box::new(move |output_grads, grads| {
        recompute::<B, C, M, I, O, F>(
            &module,
            id,
            input,
            &segment,
            &inputs,
            own_stream,
            method,
            output_grads,
            grads,
            strategy,
            &device,
        )
    });
    let joined = nodes::join_all::<B, C>(parents);
    let anchor = nodes::anchor::<B, C>(
        &joined,
        nodes::AnchorState {
            run: nodes::Once::new(run),
            stash: stash.clone(),
        },
    );

    let mut index = 0;
    output.map_floats(&mut |tensor| {
        let value = B::plain_of(tensor);
        let out = nodes::output::<B, C>(&anchor, value, index, stash.clone());
        ours::insert(out.id());
        index += 1;
        B::from_autodiff(out, strategy)
    })
}

/// Says once per segment (its module's type and method) and run that it runs without
/// checkpointing (a tracked tensor enters it other than as its input or a parameter).
fn warn_once(module: &'static str, method: &'static str) {
    let segment = memsave_common::checkpoint::segment_name(module, method);
    let part = memsave_common::run::current().part::<Uncheckpointed>();
    let mut said = nodes::lock(&part.0);
    if !said.contains(&segment) {
        said.push(segment.clone());
        tracing::warn!(
            target: "memsave",
            "`{segment}`: a tracked tensor enters this segment other than as its input or a \
             parameter of the module (captured by the closure, or a bare tensor field): it runs \
             without checkpointing (its forward runs twice: once untracked, to find out, and once \
             plainly)"
        );
    }
}

/// The segment run again from fresh leaves, its backward seeded with the outputs' gradients,
/// and the gradients registered on the outer graph's nodes.
#[allow(clippy::too_many_arguments)]
fn recompute<B, C, M, I, O, F>(
    module: &M,
    id: SegmentId,
    input: I,
    segment: &F,
    inputs: &[Option<TrackedInput>],
    own_stream: Option<(DispatchDevice, u64)>,
    method: &'static str,
    output_grads: Vec<Option<FloatTensor<B>>>,
    grads: &mut Gradients,
    strategy: GradientCheckpointingStrategy,
    device: &B::Device,
) where
    B: DispatchBackend,
    C: CheckpointStrategy,
    M: Module + 'static,
    I: Segment,
    O: Segment,
    F: Fn(&M, I) -> O,
{
    let mut leaves = Vec::new();
    let mut index = 0;
    let fresh_input = input.map_floats(&mut |tensor| {
        let tracked = inputs[index].is_some();
        index += 1;
        if !tracked {
            return untracked::<B>(tensor);
        }
        let leaf = AdTensor::<B>::new(B::autodiff_of(tensor).into_primitive()).require_grad();
        leaves.push(leaf.clone());
        B::from_autodiff(leaf, strategy)
    });
    let mut fresh = FreshParams::<B> {
        taken: Vec::new(),
        strategy,
    };
    let fresh_module = module.clone().map(&mut fresh);
    let running = state::Running::save(module);
    if let Some((device, seed)) = &own_stream {
        state::reseed(device, *seed);
    }
    let sync = || {
        let _ = B::sync(device);
    };
    let output = profile::recompute(Some(id), sync, || {
        memsave_common::memory::scope(memsave_common::memory::phase::RECOMPUTE, || {
            RECOMPUTING.with(|depth| depth.set(depth.get() + 1));
            let output = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                segment(&fresh_module, fresh_input)
            }));
            RECOMPUTING.with(|depth| depth.set(depth.get() - 1));
            output
        })
    });
    if let Some(running) = running {
        running.restore(module);
    }
    let output = match output {
        Ok(output) => output,
        // Said with the segment's name: the backtrace of a panic inside Burn's backward names
        // Burn's frames first.
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            panic!(
                "the checkpointed segment `{}` panicked while it was recomputed in backward: \
                 {message}",
                memsave_common::checkpoint::segment_name(std::any::type_name::<M>(), method)
            )
        }
    };

    // The seed: d(sum_i sum(y_i * g_i)) / d y_i = g_i, bit for bit.
    let mut seed: Option<AdTensor<B>> = None;
    for (tensor, grad) in floats(&output).into_iter().zip(output_grads) {
        let (Some(grad), true) = (grad, backend::is_tracked(&tensor)) else {
            continue;
        };
        let term = Autodiff::<B, C>::float_sum(Autodiff::<B, C>::float_mul(
            B::autodiff_of(tensor),
            AdTensor::<B>::new(grad),
        ));
        seed = Some(match seed {
            Some(sum) => Autodiff::<B, C>::float_add(sum, term),
            None => term,
        });
    }
    let inner = seed.map(|seed| seed.backward());

    let mut leaves = leaves.into_iter();
    for input in inputs.iter().flatten() {
        let leaf = leaves.next().expect("a leaf per tracked input");
        match inner.as_ref().and_then(|inner| leaf.grad(inner)) {
            Some(grad) => grads.register::<B>(input.id, grad),
            None if input.ours => grads.register::<B>(
                input.id,
                nodes::no_gradient::<B>(&input.shape, device, input.dtype),
            ),
            None if !input.leaf => {
                grads.register::<B>(input.id, zeros::<B>(&input.shape, device, input.dtype))
            }
            None => {}
        }
    }
    for param in fresh.taken {
        match inner.as_ref().and_then(|inner| param.fresh.grad(inner)) {
            Some(grad) => grads.register::<B>(param.id, grad),
            // A parameter behind a node of memsave's (a tap of the step in backward) is told
            // "none", as a segment's output is; one made by Burn's ops (not a leaf) has a step
            // that consumes a gradient.
            None if param.ours => grads.register::<B>(
                param.id,
                nodes::no_gradient::<B>(&param.fresh.shape(), device, param.fresh.dtype().into()),
            ),
            None if !param.leaf => grads.register::<B>(
                param.id,
                zeros::<B>(&param.fresh.shape(), device, param.fresh.dtype().into()),
            ),
            None => {}
        }
    }
}

/// The tracked float parameters of a module, as autodiff primitives.
struct TrackedParams<B: DispatchBackend>(Vec<AdTensor<B>>);

impl<B: DispatchBackend> burn::module::ModuleVisitor for TrackedParams<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val().into_dispatch();
        if backend::is_tracked(&tensor) {
            self.0.push(B::autodiff_of(tensor));
        }
    }
}

/// A tracked parameter and the fresh leaf that stands for it in the recomputation.
struct FreshParam<B: DispatchBackend> {
    /// The original's node.
    id: NodeId,
    /// Whether the original is a leaf (a parameter made by Burn's ops is not).
    leaf: bool,
    /// Whether the original is a node of memsave's (a tap), told "none" where it gets nothing.
    ours: bool,
    fresh: AdTensor<B>,
}

/// Each tracked parameter replaced by a fresh leaf that requires grad.
struct FreshParams<B: DispatchBackend> {
    taken: Vec<FreshParam<B>>,
    strategy: GradientCheckpointingStrategy,
}

impl<B: DispatchBackend> ModuleMapper for FreshParams<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let tensor = param.val().into_dispatch();
        if !backend::is_tracked(&tensor) {
            return param;
        }
        let original = B::autodiff_of(tensor);
        let fresh = AdTensor::<B>::new(original.primitive().clone()).require_grad();
        self.taken.push(FreshParam {
            id: original.id(),
            leaf: Autodiff::<B>::float_is_require_grad(&original),
            ours: ours::contains(original.id()),
            fresh: fresh.clone(),
        });
        let value = Tensor::from_dispatch(B::from_autodiff(fresh, self.strategy));
        param.map(|_| value)
    }
}
