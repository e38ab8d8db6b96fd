//! The segment op on a backend: the forward run untracked, the join, anchor and output nodes in
//! the outer graph, and the recomputation in the anchor's step (see the module's notes).

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
use burn::backend::{DispatchAutodiffContext, DispatchDevice, DispatchTensor, TensorMetadata};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{FloatDType, GradientCheckpointingStrategy, Shape, Tensor};

use crate::backend::{self, AdTensor, DispatchBackend, OnBackend};

use crate::checkpoint::segment::{floats, Segment};
use crate::checkpoint::{nodes, ours, state};
use memsave_common::checkpoint::{profile, SegmentId};

thread_local! {
    /// How many recomputations run on this thread now (they nest).
    static RECOMPUTING: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread is recomputing a checkpointed segment in backward.
pub fn is_recomputing() -> bool {
    RECOMPUTING.with(Cell::get) > 0
}

/// The segments of the current run that ran without checkpointing because a tracked tensor
/// entered them other than as an input or a parameter (see [`checkpoint`](super::checkpoint)), by name, in the order
/// first seen.
pub fn uncheckpointed_segments() -> Vec<String> {
    nodes::lock(&memsave_common::run::current().part::<Uncheckpointed>().0).clone()
}

/// [`uncheckpointed_segments`], a part of the run's state.
#[derive(Default)]
struct Uncheckpointed(Mutex<Vec<String>>);

/// One call of the segment op, run on the tensors' backend ([`OnBackend`]).
pub(super) struct Checkpoint<'a, M, I, O, F> {
    /// The module as the model holds it: the recomputation runs a clone.
    pub(super) module: &'a M,
    /// The segment (its type and place), as the run's record and the chooser know it.
    pub(super) id: SegmentId,
    pub(super) input: I,
    pub(super) segment: F,
    /// The segment's own random stream: its device and seed.
    pub(super) own_stream: Option<(DispatchDevice, u64)>,
    pub(super) method: &'static str,
    pub(super) output: PhantomData<O>,
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
