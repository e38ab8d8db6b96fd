//! The checkpoint op on Burn's autodiff backend.
//!
//! Forward: the segment runs once, untracked (a `no_grad()` copy of the module, detached
//! inputs), so none of its activations stay in the graph; only its inputs are kept. In the
//! graph it becomes one *anchor* node whose parents are the inputs, and one node per output
//! tensor hanging from the anchor. BatchNorm runs in training mode in that forward and updates
//! its running statistics there, once.
//!
//! Backward: once every used output has its gradient, the anchor's step recomputes the segment
//! on a helper thread (see [`super::helpers`]) from fresh leaves (the saved inputs, and copies
//! of the parameters). There, *seed* nodes hand each output its gradient as is, with no
//! arithmetic, and *tap* nodes in front of the fresh leaves send the gradients they receive
//! over a channel. Input gradients go to the anchor's parents; parameter gradients are
//! registered on the original parameters' nodes, so `GradientsParams::from_grads(grads,
//! &model)` finds them as for any other parameter.
//!
//! How the anchor knows that every tap has reported: Burn runs backward steps by descending
//! depth. Every tap is at depth 2 (leaf, then an inert *hold* node, then the tap), and a
//! *barrier* node at depth 1 joins the root; its step runs after every depth-2 step, and says
//! so. A tap that receives no gradient (an unused parameter) sends nothing, so that parameter
//! gets no gradient, as without checkpointing.
//!
//! What the recomputation does not reach. Plain Burn gives no gradient to a tensor the loss does
//! not depend on; its graph has no "no gradient" for a non-leaf node that is in the backward
//! pass, though: every such node's step consumes its gradient. So:
//! - memsave's own nodes (outputs, taps, the anchor) take "no gradient" as an answer and pass
//!   nothing on: a parameter or a leaf input the segment does not use gets no gradient, nested
//!   or not, as without checkpointing;
//! - a tracked *non-leaf* input made by Burn's ops (`z = z0 * 2` passed in) that the
//!   recomputation does not reach (an unused input, or one that feeds only an unused output)
//!   gets a zero gradient, its true value: what lies behind it then gets zeros where plain Burn
//!   would give it nothing. This is the one place where checkpointing differs from plain, and
//!   only in "none" against "zeros".
//!
//! Tensors that enter the segment other than as its input or a parameter (captured by the
//! closure, or a bare `Tensor` field of the module) cannot be recomputed from fresh leaves. The
//! untracked first forward shows them: an output that is still tracked depends on one. Such a
//! segment runs plainly instead (its activations kept, its random draws replayed), with a
//! warning that names it, once.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};

use super::context::{self, Draws};
use super::helpers;
use super::segment::{floats, Segment};
use super::CheckpointBackend;

type Ad<B, C> = Autodiff<B, C>;

/// Output gradients gathered by the output nodes for the anchor.
type Stash<B> = Arc<Mutex<Vec<Option<FloatTensor<B>>>>>;

/// The recomputation, with every type but the backend's erased.
type Run<B> = Box<dyn FnOnce(Vec<Option<FloatTensor<B>>>) -> Result<Grads<B>, String> + Send>;

/// The gradients a recomputation produced.
struct Grads<B: Backend> {
    /// Per float input, in order; `None` where the input did not require grad.
    inputs: Vec<Option<FloatTensor<B>>>,
    /// Per trainable parameter: the original parameter's node and its gradient.
    params: Vec<(NodeId, FloatTensor<B>)>,
}

/// Which fresh leaf a tap reports.
#[derive(Clone, Copy, Debug)]
enum Key {
    Input(usize),
    Param(NodeId),
}

/// From the helper thread to the waiting anchor.
enum Message<B: Backend> {
    Grad(Key, FloatTensor<B>),
    /// Every tap that will report has reported.
    Done,
    Panicked(String),
}

impl<B: Backend, C: CheckpointStrategy> CheckpointBackend for Autodiff<B, C> {
    fn is_tracked(tensor: &FloatTensor<Self>) -> bool {
        tensor.is_tracked()
    }

    fn checkpoint_segment<M, I, O, F>(method: &'static str, module: &M, input: I, segment: F) -> O
    where
        M: Module<Self> + 'static,
        I: Segment<Self>,
        O: Segment<Self>,
        F: Fn(&M, I) -> O + Send + Sync + 'static,
    {
        helpers::reap_finished();
        // Lazy parameters must be initialised before the module is copied, or each copy
        // would draw its own weights.
        module.visit(&mut Materialise);

        let detached = input
            .clone()
            .map_floats(&mut |tensor| Self::from_inner(Self::inner(tensor)));
        let untracked = module.clone().no_grad();
        let (output, draws) = context::recording(|| segment(&untracked, detached));
        drop(untracked);

        if floats(&output).iter().any(|tensor| tensor.is_tracked()) {
            // A tracked tensor entered other than as an input or a parameter: recomputing would
            // miss its gradient (or, inside a locked graph, wait forever). Run plainly, with
            // the same random draws; running statistics moved in the first forward already.
            drop(output);
            super::warn_uncheckpointed(std::any::type_name::<M>(), method);
            return context::replaying(draws, || segment(module, input));
        }

        // The nodes the recomputation's gradients go to: the tracked inputs and parameters.
        let input_nodes: Vec<Option<NodeId>> = floats(&input)
            .iter()
            .map(|tensor| tensor.is_tracked().then_some(tensor.node.id))
            .collect();
        let mut tracked = TrackedParams::default();
        module.visit(&mut tracked);
        let mut parents: Vec<FloatTensor<Self>> = floats(&input)
            .into_iter()
            .filter(|tensor| tensor.is_tracked())
            .collect();
        parents.extend(tracked.0);
        // Those that must get a gradient even if the recomputation does not reach them: the
        // non-leaf nodes of Burn's ops, whose backward step would otherwise find none.
        let needs_zeros: Vec<Zeros<B>> = parents
            .iter()
            .filter(|tensor| !tensor.node.parents.is_empty() && !ours::contains(tensor))
            .map(|tensor| Zeros {
                node: tensor.node.id,
                shape: tensor.primitive.shape(),
                dtype: tensor.primitive.dtype().into(),
                device: B::float_device(&tensor.primitive),
            })
            .collect();

        let count = floats(&output).len();
        let stash: Stash<B> = Arc::new(Mutex::new(vec![None; count]));
        let module = module.clone();
        let run: Run<B> = Box::new(move |output_grads| {
            recompute::<B, C, M, I, O, F>(module, input, segment, draws, output_grads)
        });
        let state = AnchorState {
            run: Arc::new(Mutex::new(Some(run))),
            stash: stash.clone(),
            input_nodes,
            needs_zeros: Arc::new(needs_zeros),
            like: placeholder::<B>(&parents[0].primitive),
        };
        let joined = join_all::<B, C>(parents);
        let anchor = unary::<B, C, _>(Anchor, &joined, state, placeholder::<B>(&joined.primitive));

        let mut index = 0;
        output.map_floats(&mut |tensor| {
            let out = output_node::<B, C>(&anchor, Self::inner(tensor), index, stash.clone());
            ours::insert(&out);
            index += 1;
            out
        })
    }
}

/// A node that must get a gradient: zeros of this kind if nothing else reaches it.
#[derive(Clone)]
struct Zeros<B: Backend> {
    node: NodeId,
    shape: Shape,
    dtype: FloatDType,
    device: B::Device,
}

/// The nodes memsave made on this thread (segment outputs, taps): their backward steps take
/// "no gradient" as an answer. Kept per thread because a segment's inputs are made on the
/// thread that runs its forward (the main one, or the helper recomputing an outer segment).
mod ours {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::Arc;

    use burn::backend::Autodiff;
    use burn::prelude::Backend;
    use burn::tensor::ops::FloatTensor;

    type Alive = Box<dyn Fn() -> bool>;

    thread_local! {
        /// Node id -> whether the node still exists; pruned as it grows.
        static NODES: RefCell<(HashMap<u64, Alive>, usize)> = RefCell::new((HashMap::new(), 64));
    }

    // `FloatTensor<Autodiff<B, C>>` is the same type for every strategy `C`.
    pub(super) fn insert<B: Backend>(tensor: &FloatTensor<Autodiff<B>>) {
        let weak = Arc::downgrade(&tensor.node);
        NODES.with(|nodes| {
            let (nodes, limit) = &mut *nodes.borrow_mut();
            nodes.insert(
                tensor.node.id.value,
                Box::new(move || weak.strong_count() > 0),
            );
            if nodes.len() > *limit {
                nodes.retain(|_, alive| alive());
                *limit = (nodes.len() * 2).max(64);
            }
        });
    }

    pub(super) fn contains<B: Backend>(tensor: &FloatTensor<Autodiff<B>>) -> bool {
        NODES.with(|nodes| nodes.borrow().0.contains_key(&tensor.node.id.value))
    }
}

/// The gradient registered for the node of `ops`, taken out, or `None` if nothing reached it
/// (where `Gradients::consume` would panic). `like` is any tensor on the backend.
fn take_grad<B: Backend, S, const N: usize>(
    grads: &mut Gradients,
    ops: &Ops<S, N>,
    like: &FloatTensor<B>,
) -> Option<FloatTensor<B>> {
    let mut probe = <Autodiff<B> as AutodiffBackend>::from_inner(like.clone());
    probe.node = ops.node.clone();
    grads.remove::<B>(&probe)
}

/// The tracked float parameters of a module.
#[derive(Default)]
struct TrackedParams<B: Backend, C: CheckpointStrategy>(Vec<FloatTensor<Ad<B, C>>>);

impl<B: Backend, C: CheckpointStrategy> ModuleVisitor<Ad<B, C>> for TrackedParams<B, C> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad<B, C>, D>>) {
        let primitive = param.val().into_primitive().tensor();
        if primitive.is_tracked() {
            self.0.push(primitive);
        }
    }
}

/// Forces lazy parameters to initialise in place.
struct Materialise;

impl<B: Backend> ModuleVisitor<B> for Materialise {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}

// ---------------------------------------------------------------------------------------------
// Graph nodes.

/// The anchor's state: the recomputation to run once, the output gradients, and where the
/// input gradients go.
#[derive(Clone)]
struct AnchorState<B: Backend> {
    run: Arc<Mutex<Option<Run<B>>>>,
    stash: Stash<B>,
    /// Per float input, its node if it is tracked.
    input_nodes: Vec<Option<NodeId>>,
    /// Nodes that get zeros if the recomputation gives them nothing.
    needs_zeros: Arc<Vec<Zeros<B>>>,
    /// Any one-element tensor (see [`take_grad`]).
    like: FloatTensor<B>,
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
struct Anchor;

impl<B: Backend> Backward<B, 1> for Anchor {
    type State = AnchorState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        // The output nodes that received a gradient registered a placeholder here.
        let _ = take_grad::<B, _, 1>(grads, &ops, &ops.state.like);
        let output_grads = std::mem::take(&mut *lock(&ops.state.stash));
        let mut reached = Vec::new();
        if output_grads.iter().any(Option::is_some) {
            let run = lock(&ops.state.run)
                .take()
                .expect("a checkpoint's backward runs once");
            let result = match run(output_grads) {
                Ok(result) => result,
                Err(message) => panic!("{message}"),
            };
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
struct Join;

impl<B: Backend> Backward<B, 2> for Join {
    type State = ();

    fn backward(self, _: Ops<Self::State, 2>, _: &mut Gradients, _: &mut Checkpointer) {}
}

/// One node that depends on all of `tensors` (a balanced tree of joins).
fn join_all<B: Backend, C: CheckpointStrategy>(
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
fn placeholder<B: Backend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros([1].into(), &B::float_device(like), FloatDType::F32)
}

#[derive(Debug)]
struct Output;

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
struct StashRef<B: Backend>(Stash<B>, FloatTensor<B>);

impl<B: Backend> fmt::Debug for StashRef<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Stash")
    }
}

/// The output tensor `value`, as a child of the anchor.
fn output_node<B: Backend, C: CheckpointStrategy>(
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
struct Tap;

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
struct Hold;

impl<B: Backend> Backward<B, 1> for Hold {
    type State = ();

    fn backward(self, _: Ops<Self::State, 1>, _: &mut Gradients, _: &mut Checkpointer) {}
}

/// At depth 1: its step runs after every tap's, and tells the anchor.
#[derive(Debug)]
struct Barrier;

impl<B: Backend> Backward<B, 1> for Barrier {
    type State = mpsc::Sender<Message<B>>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let _ = grads.consume::<B>(&ops.node);
        let _ = ops.state.send(Message::Done);
    }
}

/// Hands its parent (a recomputed output) the output's gradient from the outer backward.
#[derive(Debug)]
struct Seed;

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
struct GradValue<B: Backend>(FloatTensor<B>);

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
fn unary<B, C, O>(
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
fn tapped_leaf<B: Backend, C: CheckpointStrategy>(
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

// ---------------------------------------------------------------------------------------------
// Recomputation.

/// Runs on the thread of the outer backward: starts the helper, waits for its gradients.
fn recompute<B, C, M, I, O, F>(
    module: M,
    input: I,
    segment: F,
    draws: Draws,
    output_grads: Vec<Option<FloatTensor<B>>>,
) -> Result<Grads<B>, String>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Module<Ad<B, C>> + 'static,
    I: Segment<Ad<B, C>>,
    O: Segment<Ad<B, C>>,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    let input_count = floats(&input).len();
    let (sender, receiver) = mpsc::channel::<Message<B>>();
    helpers::spawn(move || {
        let report = sender.clone();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            context::replaying(draws, || {
                backprop_segment::<B, C, M, I, O, F>(module, input, segment, output_grads, sender)
            })
        }));
        if let Err(payload) = outcome {
            let _ = report.send(Message::Panicked(panic_message(payload.as_ref())));
        }
    })
    .map_err(|error| format!("memsave: could not start a recompute thread: {error}"))?;

    let lost = || {
        "memsave: the recompute thread of a checkpointed segment ended without its gradients"
            .to_string()
    };
    let mut grads = Grads {
        inputs: vec![None; input_count],
        params: Vec::new(),
    };
    loop {
        match receiver.recv().map_err(|_| lost())? {
            Message::Grad(Key::Input(index), grad) => grads.inputs[index] = Some(grad),
            Message::Grad(Key::Param(node), grad) => grads.params.push((node, grad)),
            Message::Done => return Ok(grads),
            Message::Panicked(message) => return Err(recompute_panic(&message)),
        }
    }
}

fn recompute_panic(message: &str) -> String {
    format!(
        "memsave: a checkpointed segment panicked while it was recomputed in backward: {message}"
    )
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Runs on the helper thread: recompute from fresh leaves, seed the outputs with their
/// gradients, back-propagate.
fn backprop_segment<B, C, M, I, O, F>(
    module: M,
    input: I,
    segment: F,
    output_grads: Vec<Option<FloatTensor<B>>>,
    sender: mpsc::Sender<Message<B>>,
) where
    B: Backend,
    C: CheckpointStrategy,
    M: Module<Ad<B, C>> + 'static,
    I: Segment<Ad<B, C>>,
    O: Segment<Ad<B, C>>,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    let mut index = 0;
    let input = input.map_floats(&mut |tensor| {
        let key = Key::Input(index);
        index += 1;
        let tracked = tensor.is_tracked();
        let value = Ad::<B, C>::inner(tensor);
        if tracked {
            tapped_leaf::<B, C>(value, key, &sender)
        } else {
            Ad::<B, C>::from_inner(value)
        }
    });
    let module = module.map(&mut FreshLeaves::<B, C> {
        sender: sender.clone(),
        _strategy: std::marker::PhantomData,
    });

    let output = segment(&module, input);

    // The anchor only runs once an output has its gradient: there is one to size things by.
    let like = output_grads
        .iter()
        .flatten()
        .next()
        .map(placeholder::<B>)
        .expect("an output gradient reached the checkpoint");
    let mut roots: Vec<FloatTensor<Ad<B, C>>> = Vec::new();
    for (y, dy) in floats(&output).into_iter().zip(output_grads) {
        if let Some(dy) = dy {
            let placeholder = placeholder::<B>(&dy);
            roots.push(unary::<B, C, _>(Seed, &y, GradValue(dy), placeholder));
        }
    }
    drop(output);
    drop(module);
    let barrier_leaf =
        Ad::<B, C>::float_set_require_grad(Ad::<B, C>::from_inner(like.clone()), true);
    roots.push(unary::<B, C, _>(Barrier, &barrier_leaf, sender, like));
    let root = roots
        .into_iter()
        .reduce(Ad::<B, C>::float_add)
        .expect("the barrier is a root");
    // Returns only after the outer backward has released its lock (see `helpers`); the taps and
    // the barrier have reported long before.
    drop(Ad::<B, C>::backward(root));
}

/// Copies of the trainable parameters as fresh leaves behind taps. Frozen parameters and
/// running statistics (which are not tracked) are left as they are.
struct FreshLeaves<B: Backend, C: CheckpointStrategy> {
    sender: mpsc::Sender<Message<B>>,
    _strategy: std::marker::PhantomData<C>,
}

impl<B: Backend, C: CheckpointStrategy> ModuleMapper<Ad<B, C>> for FreshLeaves<B, C> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Ad<B, C>, D>>,
    ) -> Param<Tensor<Ad<B, C>, D>> {
        let (id, tensor, mapper) = param.consume();
        let primitive = tensor.into_primitive().tensor();
        // Tracked, not only leaves: in a segment nested in another's recomputation, the
        // parameters are the outer recomputation's taps. Left in place they would tie this
        // recomputation to the outer one's graph, which its backward holds locked.
        let value = if primitive.is_tracked() {
            let original = primitive.node.id;
            let value = Ad::<B, C>::inner(primitive);
            tapped_leaf::<B, C>(value, Key::Param(original), &self.sender)
        } else {
            primitive
        };
        Param::from_mapped_value(
            id,
            Tensor::from_primitive(TensorPrimitive::Float(value)),
            mapper,
        )
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Poisoned only if a step panicked, which the backward pass has reported already.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
