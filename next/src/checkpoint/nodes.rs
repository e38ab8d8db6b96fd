//! The nodes a segment leaves in the outer graph, and their backward steps.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::Shape;

use crate::backend::AdTensor;

/// The segment's output gradients, gathered by the output nodes for the anchor.
pub(super) type Stash<B> = Arc<Mutex<Vec<Option<FloatTensor<B>>>>>;

/// The recomputation: from the outputs' gradients (`None` where an output got none), registers
/// the gradients of the segment's inputs and parameters in the outer pass's `Gradients`.
pub(super) type Run<B> = Box<dyn FnOnce(Vec<Option<FloatTensor<B>>>, &mut Gradients) + Send>;

/// A value taken once by a backward step (a step's state must be `Clone` and `Debug`).
pub(super) struct Once<T>(Arc<Mutex<Option<T>>>);

impl<T> Once<T> {
    pub(super) fn new(value: T) -> Self {
        Once(Arc::new(Mutex::new(Some(value))))
    }

    fn take(&self) -> Option<T> {
        lock(&self.0).take()
    }
}

impl<T> Clone for Once<T> {
    fn clone(&self) -> Self {
        Once(self.0.clone())
    }
}

impl<T> std::fmt::Debug for Once<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Once")
    }
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Poisoned only if a step panicked, which the backward pass reports already.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records a compute-bound node of `backward` over `parents` (its output `output`): the
/// segments' nodes and the lean layers' ops (`crate::nn`).
pub(crate) fn node<B, C, BO, const N: usize>(
    backward: BO,
    parents: [&AdTensor<B>; N],
    state: BO::State,
    output: FloatTensor<B>,
) -> AdTensor<B>
where
    B: Backend,
    C: CheckpointStrategy,
    BO: Backward<B, N>,
{
    match backward
        .prepare::<C>(parents.map(|parent| parent.node()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

/// A one-value tensor standing for a node that carries no value of its own.
pub(super) fn placeholder<B: Backend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(Shape::new([1]), &like.device(), like.dtype().into())
}

/// Joins two parents into one node (the anchor's parent): its step has nothing to do, since
/// the anchor registers the inputs' and parameters' gradients by their ids.
#[derive(Debug)]
struct Join;

impl<B: Backend> Backward<B, 2> for Join {
    type State = ();

    fn backward(self, _ops: Ops<(), 2>, _grads: &mut Gradients, _: &mut Checkpointer) {}
}

/// The parents, joined pairwise into one node (the one parent itself where there is one).
pub(super) fn join_all<B: Backend, C: CheckpointStrategy>(
    mut parents: Vec<AdTensor<B>>,
) -> AdTensor<B> {
    while parents.len() > 1 {
        let mut joined = Vec::with_capacity(parents.len().div_ceil(2));
        let mut pairs = parents.into_iter();
        while let Some(left) = pairs.next() {
            match pairs.next() {
                Some(right) => {
                    let output = placeholder::<B>(left.primitive());
                    joined.push(node::<B, C, _, 2>(Join, [&left, &right], (), output));
                }
                None => joined.push(left),
            }
        }
        parents = joined;
    }
    parents
        .pop()
        .expect("a segment with a tracked input has a parent")
}

/// The segment's node: its step runs once every output node's has (Burn runs steps by
/// descending depth, and the outputs hang from it), and recomputes the segment.
#[derive(Debug)]
pub(super) struct Anchor;

#[derive(Debug)]
pub(super) struct AnchorState<B: Backend> {
    pub(super) run: Once<Run<B>>,
    pub(super) stash: Stash<B>,
}

impl<B: Backend> Clone for AnchorState<B> {
    fn clone(&self) -> Self {
        AnchorState {
            run: self.run.clone(),
            stash: self.stash.clone(),
        }
    }
}

impl<B: Backend> Backward<B, 1> for Anchor {
    type State = AnchorState<B>;

    fn backward(self, ops: Ops<AnchorState<B>, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let outputs = std::mem::take(&mut *lock(&ops.state.stash));
        if let Some(run) = ops.state.run.take() {
            run(outputs, grads);
        }
    }
}

pub(super) fn anchor<B: Backend, C: CheckpointStrategy>(
    parent: &AdTensor<B>,
    state: AnchorState<B>,
) -> AdTensor<B> {
    let output = placeholder::<B>(parent.primitive());
    node::<B, C, _, 1>(Anchor, [parent], state, output)
}

/// One output of the segment: its step hands its gradient to the anchor as it is.
#[derive(Debug)]
struct Output;

#[derive(Debug)]
struct OutputState<B: Backend> {
    index: usize,
    stash: Stash<B>,
    shape: Shape,
}

impl<B: Backend> Clone for OutputState<B> {
    fn clone(&self) -> Self {
        OutputState {
            index: self.index,
            stash: self.stash.clone(),
            shape: self.shape.clone(),
        }
    }
}

impl<B: Backend> Backward<B, 1> for Output {
    type State = OutputState<B>;

    fn backward(self, ops: Ops<OutputState<B>, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        // Something is always registered (see `no_gradient`); a gradient of another shape is
        // the mark of "none".
        let grad = grads.consume::<B>(&ops.node);
        let grad = (grad.shape() == ops.state.shape).then_some(grad);
        lock(&ops.state.stash)[ops.state.index] = grad;
    }
}

pub(super) fn output<B: Backend, C: CheckpointStrategy>(
    anchor: &AdTensor<B>,
    value: FloatTensor<B>,
    index: usize,
    stash: Stash<B>,
) -> AdTensor<B> {
    let shape = value.shape();
    node::<B, C, _, 1>(
        Output,
        [anchor],
        OutputState {
            index,
            stash,
            shape,
        },
        value,
    )
}

/// What a segment registers for an input of `shape` that its recomputation gave no gradient,
/// where the input is another segment's output (whose step consumes a gradient, and would
/// panic on none): negative zeros of shape `[1, ..]`, which add to any gradient registered
/// beside them without changing a bit (x + -0 = x) and, alone, tell the output node "none" by
/// their shape. An output whose own shape is `[1, ..]` gets zeros of its shape (a true zero
/// gradient: "none" becomes "zeros" there only).
pub(super) fn no_gradient<B: Backend>(
    shape: &Shape,
    device: &B::Device,
    dtype: burn::tensor::FloatDType,
) -> FloatTensor<B> {
    let ones = Shape::from(vec![1; shape.num_dims()]);
    if *shape == ones {
        B::float_zeros(shape.clone(), device, dtype)
    } else {
        B::float_neg(B::float_zeros(ones, device, dtype))
    }
}
