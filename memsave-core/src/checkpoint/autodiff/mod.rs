//! The checkpoint op on Burn's autodiff backend.
//!
//! Forward: the segment runs once, untracked (a `no_grad()` copy of the module, detached
//! inputs), so none of its activations stay in the graph; only its inputs are kept. In the
//! graph it becomes one *anchor* node whose parents are the inputs, and one node per output
//! tensor hanging from the anchor. BatchNorm runs in training mode in that forward and updates
//! its running statistics there, once.
//!
//! Backward: once every used output has its gradient, the anchor's step recomputes the segment
//! on a helper thread (see [`super::threads`]) from fresh leaves (the saved inputs, and copies
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

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::Ops;
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata};

use super::context;
use super::segment::{floats, Segment};
use super::threads;
use super::CheckpointBackend;

mod nodes;
mod recompute;

use nodes::{join_all, output_node, placeholder, unary, Anchor, AnchorState};
use recompute::recompute;

pub(super) type Ad<B, C> = Autodiff<B, C>;

/// Output gradients gathered by the output nodes for the anchor.
pub(super) type Stash<B> = Arc<Mutex<Vec<Option<FloatTensor<B>>>>>;

/// The recomputation, with every type but the backend's erased.
pub(super) type Run<B> =
    Box<dyn FnOnce(Vec<Option<FloatTensor<B>>>) -> Result<Grads<B>, Ended> + Send>;

/// Why a recomputation gave no gradients.
pub(super) enum Ended {
    /// The step failed ([`crate::run`]'s failure: an offloaded input lost, no thread to
    /// recompute on): the backward goes on without this segment's gradients, and whoever drives
    /// the step ends it with the error.
    Failed(crate::Error),
    /// The segment's code (the user's) panicked on the helper: the panic goes on on the outer
    /// backward's thread, as it would have without checkpointing.
    Panicked(String),
}

/// The gradients a recomputation produced.
pub(super) struct Grads<B: Backend> {
    /// Per float input, in order; `None` where the input did not require grad.
    inputs: Vec<Option<FloatTensor<B>>>,
    /// Per trainable parameter: the original parameter's node and its gradient.
    params: Vec<(NodeId, FloatTensor<B>)>,
}

/// Which fresh leaf a tap reports.
#[derive(Clone, Copy, Debug)]
pub(super) enum Key {
    Input(usize),
    Param(NodeId),
}

/// From the helper thread to the waiting anchor.
pub(super) enum Message<B: Backend> {
    Grad(Key, FloatTensor<B>),
    /// Every tap that will report has reported.
    Done,
    Panicked(String),
}

impl<B: Backend, C: CheckpointStrategy> CheckpointBackend for Autodiff<B, C> {
    fn is_tracked(tensor: &FloatTensor<Self>) -> bool {
        tensor.is_tracked()
    }

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
        F: Fn(&M, I) -> O + Send + Sync + 'static,
    {
        threads::reap_finished();
        // Lazy parameters must be initialised before the module is copied, or each copy
        // would draw its own weights.
        module.visit(&mut Materialise);

        let detached = input
            .clone()
            .map_floats(&mut |tensor| Self::from_inner(Self::inner(tensor)));
        let untracked = module.clone().no_grad();
        let (output, draws) = context::recording(|| segment(&untracked, detached));
        drop(untracked);

        if floats(&output).is_empty() {
            // Nothing for a gradient to flow through: the first forward's output is the result.
            return output;
        }
        if floats(&output).iter().any(|tensor| tensor.is_tracked()) {
            // A tracked tensor entered other than as an input or a parameter: recomputing would
            // miss its gradient (or, inside a locked graph, wait forever). Run plainly, with
            // the same random draws, on a helper thread: Burn's `RunningState` keeps one update
            // per thread and averages them, so the statistics moved in the first forward are
            // not moved a second time.
            drop(output);
            super::warn_uncheckpointed(std::any::type_name::<M>(), method);
            let device = floats(&input)
                .first()
                .map(|tensor| B::float_device(&tensor.primitive));
            let module = module.clone();
            return threads::run_on_helper(move || {
                context::replaying(draws, stream.is_some(), || {
                    if let (Some(seed), Some(device)) = (stream, &device) {
                        B::seed(device, seed);
                    }
                    segment(&module, input)
                })
            });
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
        let id = super::profile::pending();
        // With activation offload, the kept input waits in host memory (`super::offload`).
        let (input, staged) = super::offload::stage::<B, C, I>(input, stage, || {
            super::id::segment_name(std::any::type_name::<M>(), method)
        });
        let run: Run<B> = Box::new(move |output_grads| {
            let input = match staged {
                Some(staged) => staged.restore::<C, I>(input).map_err(Ended::Failed)?,
                None => input,
            };
            recompute::<B, C, M, I, O, F>(module, input, segment, draws, stream, output_grads, id)
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
pub(super) struct Zeros<B: Backend> {
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

/// Marks `tensor`'s node as one of memsave's, which takes "no gradient" as an answer (a
/// parameter's tap, [`crate::train::taps`]): a segment's recomputation that does not reach it
/// gives it no zeros.
pub(crate) fn mark_ours<B: Backend>(tensor: &FloatTensor<Autodiff<B>>) {
    ours::insert(tensor);
}

/// The gradient registered for the node of `ops`, taken out, or `None` if nothing reached it
/// (where `Gradients::consume` would panic). `like` is any tensor on the backend.
pub(crate) fn take_grad<B: Backend, S, const N: usize>(
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
pub(super) struct TrackedParams<B: Backend, C: CheckpointStrategy>(Vec<FloatTensor<Ad<B, C>>>);

impl<B: Backend, C: CheckpointStrategy> ModuleVisitor<Ad<B, C>> for TrackedParams<B, C> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad<B, C>, D>>) {
        let primitive = param.val().into_primitive().tensor();
        if primitive.is_tracked() {
            self.0.push(primitive);
        }
    }
}

/// Forces lazy parameters to initialise in place.
pub(super) struct Materialise;

impl<B: Backend> ModuleVisitor<B> for Materialise {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Poisoned only if a step panicked, which the backward pass has reported already.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
