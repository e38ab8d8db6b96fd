//! The nodes the checkpoint op adds to Burn's graph (see the parent module's drawing): the
//! anchor and its joins in the outer graph, the outputs hanging from it, and in the
//! recomputation's graph the seeds, taps, holds and the barrier.

use std::fmt;
use std::sync::{mpsc, Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::FloatDType;

use super::{lock, ours, take_grad, Ad, Ended, Key, Message, Run, Stash, Zeros};
// ---------------------------------------------------------------------------------------------
// Graph nodes.

/// The anchor's state: the recomputation to run once, the output gradients, and where the
/// input gradients go.
#[derive(Clone)]
pub(super) struct AnchorState<B: Backend> {
    pub(super) run: Arc<Mutex<Option<Run<B>>>>,
    pub(super) stash: Stash<B>,
    /// Per float input, its node if it is tracked.
    pub(super) input_nodes: Vec<Option<NodeId>>,
    /// Nodes that get zeros if the recomputation gives them nothing.
    pub(super) needs_zeros: Arc<Vec<Zeros<B>>>,
    /// Any one-element tensor (see [`take_grad`]).
    pub(super) like: FloatTensor<B>,
}

impl<B: Backend> fmt::Debug for AnchorState<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AnchorState")
    }
}

/// Its parent joins every tracked input and parameter of the segment, so that all of them are
/// in the backward pass, below the anchor: the gradients it registers for them are consumed
/// after it has run.
#[derive(Debug)]
pub(super) struct Anchor;

impl<B: Backend> Backward<B, 1> for Anchor {
    type State = AnchorState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        // The output nodes that received a gradient registered a placeholder here.
        let _ = take_grad::<B, _, 1>(grads, &ops, &ops.state.like);
        let output_grads = std::mem::take(&mut *lock(&ops.state.stash));
        let mut reached = Vec::new();
        let run = lock(&ops.state.run)
            .take()
            .expect("a checkpoint's backward runs once");
        // After the step failed, the recomputations left are skipped: their gradients would
        // not be used.
        let result = if output_grads.iter().any(Option::is_some) && !crate::run::has_failed() {
            match run(output_grads) {
                Ok(result) => Some(result),
                Err(Ended::Failed(error)) => {
                    crate::run::fail(error);
                    None
                }
                // The segment's own panic, as without checkpointing.
                Err(Ended::Panicked(message)) => panic!("{message}"),
            }
        } else {
            None
        };
        if let Some(result) = result {
            for (node, grad) in ops.state.input_nodes.iter().zip(result.inputs) {
                if let (Some(node), Some(grad)) = (node, grad) {
                    grads.register::<B>(*node, grad);
                    reached.push(*node);
                }
            }
            for (node, grad) in result.params {
                grads.register::<B>(node, grad);
                reached.push(node);
            }
        }
        for zeros in ops.state.needs_zeros.iter() {
            if !reached.contains(&zeros.node) {
                let value = B::float_zeros(zeros.shape.clone(), &zeros.device, zeros.dtype);
                grads.register::<B>(zeros.node, value);
            }
        }
    }
}

/// Two parents, no backward: a piece of the tree under the anchor.
#[derive(Debug)]
pub(super) struct Join;

impl<B: Backend> Backward<B, 2> for Join {
    type State = ();

    fn backward(self, _: Ops<Self::State, 2>, _: &mut Gradients, _: &mut Checkpointer) {}
}

/// One node that depends on all of `tensors` (a balanced tree of joins).
pub(super) fn join_all<B: Backend, C: CheckpointStrategy>(
    mut tensors: Vec<FloatTensor<Ad<B, C>>>,
) -> FloatTensor<Ad<B, C>> {
    assert!(
        !tensors.is_empty(),
        "checkpoint only records a tracked segment"
    );
    while tensors.len() > 1 {
        let mut next = Vec::with_capacity(tensors.len().div_ceil(2));
        let mut pairs = tensors.into_iter();
        while let Some(left) = pairs.next() {
            match pairs.next() {
                Some(right) => {
                    let value = placeholder::<B>(&left.primitive);
                    let nodes = [left.node.clone(), right.node.clone()];
                    next.push(match Join.prepare::<C>(nodes).compute_bound().stateful() {
                        OpsKind::Tracked(prep) => prep.finish((), value),
                        OpsKind::UnTracked(prep) => prep.finish(value),
                    });
                }
                None => next.push(left),
            }
        }
        tensors = next;
    }
    tensors.pop().expect("one tensor is left")
}

/// A one-element fp32 tensor on the device of `like`.
pub(super) fn placeholder<B: Backend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros([1].into(), &B::float_device(like), FloatDType::F32)
}

#[derive(Debug)]
pub(super) struct Output;

impl<B: Backend> Backward<B, 1> for Output {
    type State = (usize, StashRef<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (index, StashRef(stash, like)) = ops.state.clone();
        // Nothing reached this output (a later segment ignored it): neither does the anchor.
        let Some(grad) = take_grad::<B, _, 1>(grads, &ops, &like) else {
            return;
        };
        let [anchor] = ops.parents;
        let Some(anchor) = anchor else { return };
        grads.register::<B>(anchor.id, like);
        lock(&stash)[index] = Some(grad);
    }
}

/// [`Stash`] with the `Debug` that `Backward::State` asks for, and a one-element tensor.
#[derive(Clone)]
pub(super) struct StashRef<B: Backend>(Stash<B>, FloatTensor<B>);

impl<B: Backend> fmt::Debug for StashRef<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Stash")
    }
}

/// The output tensor `value`, as a child of the anchor.
pub(super) fn output_node<B: Backend, C: CheckpointStrategy>(
    anchor: &FloatTensor<Ad<B, C>>,
    value: FloatTensor<B>,
    index: usize,
    stash: Stash<B>,
) -> FloatTensor<Ad<B, C>> {
    match <Output as Backward<B, 1>>::prepare::<C>(Output, [anchor.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let like = placeholder::<B>(&value);
            prep.finish((index, StashRef(stash, like)), value)
        }
        OpsKind::UnTracked(prep) => prep.finish(value),
    }
}

/// An identity whose backward sends the gradient it receives to the waiting anchor (and passes
/// nothing on: the fresh leaf behind it is thrown away).
#[derive(Debug)]
pub(super) struct Tap;

impl<B: Backend> Backward<B, 1> for Tap {
    type State = (Key, mpsc::Sender<Message<B>>, GradValue<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (key, sender, GradValue(like)) = ops.state.clone();
        // Nothing reached this leaf (a segment nested in the recomputation did not use it):
        // it gets no gradient, as without checkpointing.
        let Some(grad) = take_grad::<B, _, 1>(grads, &ops, &like) else {
            return;
        };
        // The anchor may have given up (the recomputation panicked): nothing to do then.
        let _ = sender.send(Message::Grad(key, grad));
    }
}

/// An identity with no backward: it only puts the tap in front of it at depth 2.
#[derive(Debug)]
pub(super) struct Hold;

impl<B: Backend> Backward<B, 1> for Hold {
    type State = ();

    fn backward(self, _: Ops<Self::State, 1>, _: &mut Gradients, _: &mut Checkpointer) {}
}

/// At depth 1: its step runs after every tap's, and tells the anchor.
#[derive(Debug)]
pub(super) struct Barrier;

impl<B: Backend> Backward<B, 1> for Barrier {
    type State = mpsc::Sender<Message<B>>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let _ = grads.consume::<B>(&ops.node);
        // The helper's products are done (what is left is the root's addition and the clean-up,
        // which waits for the outer backward): its scratch goes now, not when the thread ends.
        super::super::threads::release_scratch();
        let _ = ops.state.send(Message::Done);
    }
}

/// Hands its parent (a recomputed output) the output's gradient from the outer backward.
#[derive(Debug)]
pub(super) struct Seed;

impl<B: Backend> Backward<B, 1> for Seed {
    type State = GradValue<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let _ = grads.consume::<B>(&ops.node);
        if let [Some(output)] = &ops.parents {
            grads.register::<B>(output.id, ops.state.0);
        }
    }
}

/// A gradient, with the `Debug` that `Backward::State` asks for.
#[derive(Clone)]
pub(super) struct GradValue<B: Backend>(pub(super) FloatTensor<B>);

impl<B: Backend> fmt::Debug for GradValue<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GradValue")
    }
}

impl<B: Backend> fmt::Debug for Message<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Message::Grad(key, _) => write!(f, "Grad({key:?})"),
            Message::Done => f.write_str("Done"),
            Message::Panicked(message) => write!(f, "Panicked({message})"),
        }
    }
}

/// A unary node over `parent` with `value` as its output.
pub(super) fn unary<B, C, O>(
    op: O,
    parent: &FloatTensor<Ad<B, C>>,
    state: O::State,
    value: FloatTensor<B>,
) -> FloatTensor<Ad<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    O: Backward<B, 1>,
{
    match op
        .prepare::<C>([parent.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, value),
        OpsKind::UnTracked(prep) => prep.finish(value),
    }
}

/// A fresh leaf with `value`, held at depth 1 and tapped at depth 2.
pub(super) fn tapped_leaf<B: Backend, C: CheckpointStrategy>(
    value: FloatTensor<B>,
    key: Key,
    sender: &mpsc::Sender<Message<B>>,
) -> FloatTensor<Ad<B, C>> {
    let leaf = Ad::<B, C>::float_set_require_grad(Ad::<B, C>::from_inner(value.clone()), true);
    let held = unary::<B, C, _>(Hold, &leaf, (), value.clone());
    let like = GradValue(placeholder::<B>(&value));
    let tap = unary::<B, C, _>(Tap, &held, (key, sender.clone(), like), value);
    ours::insert(&tap);
    tap
}
