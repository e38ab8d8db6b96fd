//! Taps: a node in front of each trainable parameter whose backward step runs as soon as the
//! parameter's gradient is final and hands it to a [`Sink`] (PyTorch's
//! `register_post_accumulate_grad_hook`), so that the optimizer can step that parameter during
//! backward and free its gradient at once.
//!
//! ```text
//!   w (leaf) ─────► tap ─────► every use of w in the forward (a conv, a matmul, an anchor)
//!                    ▲
//!   depth[k] ········┘   untracked: deepens the tap, adds no edge
//! ```
//!
//! Burn runs backward steps by descending depth (a node is one deeper than its deepest parent),
//! so a tap runs after every use of its parameter: its gradient is final then. A tap over the
//! leaf alone would be at depth 1 and run last of all, when every gradient exists anyway, so
//! its second parent is an untracked node of a chosen depth: an untracked parent adds no edge
//! (no gradient flows to it, no step runs for it) but counts in the depth. The `k`-th trainable
//! parameter in the model's visiting order gets depth `k * gap + 2`, `gap` larger than the ops
//! between two parameters' first uses: the taps' depths then set those of the ops after them,
//! and backward runs the model's ops and taps in the reverse of the visiting order, each tap
//! right after the backward of the part of the model from its parameter's first use on. Where
//! the visiting order is not the forward's, a tap runs later than it could, never before its
//! gradient is final.
//!
//! The untracked nodes that set the depths are made once per [`DepthChain`] (one-element, all
//! sharing one value) and kept; each step adds one tap per trainable parameter.
//!
//! A backward can also be given an end ([`with_end`]): a step of depth 1, below every tap, that
//! runs after all of them, inside the backward, whichever taps ran.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::module::{ModuleMapper, Param, ParamId};
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::checkpoint::{mark_ours, take_grad};

/// Where a tap hands its parameter's final gradient.
pub(crate) trait Sink<K: Backend>: Send + Sync + 'static {
    /// `grad` is the final gradient of the parameter `id` (of rank `D`); `backward`: the
    /// gradients of the backward pass under way (where the nodes of taps that did not run keep
    /// what was seeded on them, [`seeded_on`]).
    fn on_grad<const D: usize>(&self, id: ParamId, grad: Tensor<K, D>, backward: &mut Gradients);
}

/// Whether `B` is Burn's autodiff over its inner backend (any checkpoint strategy): the only
/// backend whose graph taps can join.
pub(crate) fn can_tap<B: AutodiffBackend>() -> bool {
    std::any::TypeId::of::<FloatTensor<B>>()
        == std::any::TypeId::of::<FloatTensor<Autodiff<B::InnerBackend>>>()
}

fn cast<F: 'static, T: 'static>(value: F) -> T {
    let boxed: Box<dyn std::any::Any> = Box::new(value);
    *boxed
        .downcast::<T>()
        .ok()
        .expect("the backend was checked to be Burn's autodiff (`can_tap`)")
}

/// Untracked one-element nodes of the depths the taps ask for: their second parents. A node of
/// depth `d` is made by `d` links from the root; only the nodes asked for are kept (one per
/// tapped parameter, reused every step), the links between them freed.
pub(crate) struct DepthChain<K: Backend> {
    nodes: std::collections::BTreeMap<usize, FloatTensor<Autodiff<K>>>,
    /// Any one-element tensor on the device (for [`take_grad`]).
    like: FloatTensor<K>,
}

impl<K: Backend> DepthChain<K> {
    /// An empty chain on `device`.
    pub(crate) fn new(device: &K::Device) -> Self {
        let like = Tensor::<K, 1>::zeros([1], device).into_primitive().tensor();
        DepthChain {
            nodes: std::collections::BTreeMap::new(),
            like,
        }
    }

    /// A one-element tensor on the chain's device.
    pub(crate) fn like(&self) -> &FloatTensor<K> {
        &self.like
    }

    /// The node of depth `depth`, made (and kept) if it is not there.
    fn at(&mut self, depth: usize) -> &FloatTensor<Autodiff<K>> {
        if !self.nodes.contains_key(&depth) {
            // From the deepest node kept above which `depth` lies.
            let (mut node, mut reached) = match self.nodes.range(..depth).next_back() {
                Some((&reached, node)) => (node.clone(), reached),
                None => (
                    <Autodiff<K> as AutodiffBackend>::from_inner(self.like.clone()),
                    0,
                ),
            };
            while reached < depth {
                let value = node.primitive.clone();
                node = match Link
                    .prepare::<NoCheckpointing>([node.node.clone()])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish((), value),
                    OpsKind::UnTracked(prep) => prep.finish(value),
                };
                reached += 1;
            }
            self.nodes.insert(depth, node);
        }
        &self.nodes[&depth]
    }
}

/// A link of the depth chain: never tracked, so its step never runs.
#[derive(Debug)]
struct Link;

impl<K: Backend> Backward<K, 1> for Link {
    type State = ();

    fn backward(self, _: Ops<Self::State, 1>, _: &mut Gradients, _: &mut Checkpointer) {}
}

type OnGrad<K> = Box<dyn FnOnce(FloatTensor<K>, &mut Gradients) + Send>;

#[derive(Clone)]
struct TapState<K: Backend> {
    on_grad: Arc<Mutex<Option<OnGrad<K>>>>,
    like: FloatTensor<K>,
}

impl<K: Backend> fmt::Debug for TapState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TapState")
    }
}

/// The tap: its output is its parameter's value; its step hands the gradient its output
/// received (the parameter's, whole) to the sink and passes nothing on.
#[derive(Debug)]
struct Tap;

impl<K: Backend> Backward<K, 2> for Tap {
    type State = TapState<K>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = take_grad::<K, _, 2>(grads, &ops, &ops.state.like);
        let on_grad = ops
            .state
            .on_grad
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let (Some(on_grad), Some(grad)) = (on_grad, grad) {
            on_grad(grad, grads);
        }
    }
}

/// Replaces every trainable float parameter of a model by its tap (see the module docs); the
/// tapped parameters' ids, in visiting order, are in `ids`.
pub(crate) struct Tapper<'a, B: AutodiffBackend, S: Sink<B::InnerBackend>> {
    chain: &'a mut DepthChain<B::InnerBackend>,
    gap: usize,
    sink: Arc<S>,
    /// A parameter held twice (one `ParamId`) gets one tap.
    seen: HashMap<ParamId, Box<dyn std::any::Any>>,
    /// The tapped parameters, in visiting order.
    pub(crate) ids: Vec<ParamId>,
    /// Each tap's node, for what a backward that did not run the tap left on it (see
    /// [`seeded_on`]).
    pub(crate) keys: HashMap<ParamId, FloatTensor<Autodiff<B::InnerBackend>>>,
}

impl<'a, B: AutodiffBackend, S: Sink<B::InnerBackend>> Tapper<'a, B, S> {
    /// Taps handing gradients to `sink`, `gap` deep apart (at least 1).
    pub(crate) fn new(
        chain: &'a mut DepthChain<B::InnerBackend>,
        gap: usize,
        sink: Arc<S>,
    ) -> Self {
        Tapper {
            chain,
            gap: gap.max(1),
            sink,
            seen: HashMap::new(),
            ids: Vec::new(),
            keys: HashMap::new(),
        }
    }
}

impl<B: AutodiffBackend, S: Sink<B::InnerBackend>> ModuleMapper<B> for Tapper<'_, B, S> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        if let Some(tapped) = self.seen.get(&id) {
            let tapped = tapped
                .downcast_ref::<Tensor<B, D>>()
                .expect("one parameter id, one rank")
                .clone();
            return Param::from_mapped_value(id, tapped, mapper);
        }
        type K<B> = <B as AutodiffBackend>::InnerBackend;
        let leaf: FloatTensor<Autodiff<K<B>>> = cast(tensor.into_primitive().tensor());
        // Depth 1 is the end's ([`with_end`]): the taps are below it.
        let depth = self.ids.len() * self.gap + 1;
        let sink = self.sink.clone();
        let on_grad: OnGrad<K<B>> = Box::new(move |grad, backward| {
            sink.on_grad::<D>(
                id,
                Tensor::from_primitive(TensorPrimitive::Float(grad)),
                backward,
            )
        });
        let state = TapState {
            on_grad: Arc::new(Mutex::new(Some(on_grad))),
            like: self.chain.like.clone(),
        };
        let value = leaf.primitive.clone();
        let parent = self.chain.at(depth).node.clone();
        let tapped = match Tap
            .prepare::<NoCheckpointing>([leaf.node.clone(), parent])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        };
        mark_ours::<K<B>>(&tapped);
        // The tap's node behind a one-element value (the weight is not held) and a count of
        // its own (the graph's bookkeeping does not see it).
        let mut key = tapped.clone();
        key.primitive = self.chain.like.clone();
        key.rc = Arc::new(key.node.id);
        self.keys.insert(id, key);
        let tapped: Tensor<B, D> = Tensor::from_primitive(TensorPrimitive::Float(cast(tapped)));
        self.seen.insert(id, Box::new(tapped.clone()));
        self.ids.push(id);
        Param::from_mapped_value(id, tapped, mapper)
    }
}

type OnEnd = Box<dyn FnOnce(&mut Gradients) + Send>;

#[derive(Clone)]
struct EndState(Arc<Mutex<Option<OnEnd>>>);

impl fmt::Debug for EndState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EndState")
    }
}

/// The end of a backward: a step of depth 1 (its parent a tracked one-element leaf) that no
/// gradient reaches, which runs `on_end` after every tap.
#[derive(Debug)]
struct End;

impl<K: Backend> Backward<K, 1> for End {
    type State = EndState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let on_end = ops
            .state
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(on_end) = on_end {
            on_end(grads);
        }
    }
}

/// `loss` joined to the end: its value and gradient are the loss's, passed on untouched.
#[derive(Debug)]
struct Join;

impl<K: Backend> Backward<K, 2> for Join {
    type State = FloatTensor<K>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [loss, _end] = &ops.parents;
        if let (Some(loss), Some(grad)) = (loss, take_grad::<K, _, 2>(grads, &ops, &ops.state)) {
            grads.register::<K>(loss.id, grad);
        }
    }
}

/// `loss` (on Burn's autodiff: `can_tap`) with an end: its backward runs `on_end` (with the
/// pass's gradients) once every tap's step has run, before the backward returns. With peers
/// on threads of one process, what the peers must do together in backward is done there: a
/// peer whose backward has returned takes every graph's lock to clean up (Burn 0.21's
/// `GraphCleaner`), which waits for a peer still in its backward.
pub(crate) fn with_end<B: AutodiffBackend>(
    loss: Tensor<B, 1>,
    like: &FloatTensor<B::InnerBackend>,
    on_end: impl FnOnce(&mut Gradients) + Send + 'static,
) -> Tensor<B, 1> {
    type K<B> = <B as AutodiffBackend>::InnerBackend;
    let loss: FloatTensor<Autodiff<K<B>>> = cast(loss.into_primitive().tensor());
    let leaf: FloatTensor<Autodiff<K<B>>> =
        Tensor::<Autodiff<K<B>>, 1>::from_primitive(TensorPrimitive::Float(
            <Autodiff<K<B>> as AutodiffBackend>::from_inner(like.clone()),
        ))
        .require_grad()
        .into_primitive()
        .tensor();
    let state = EndState(Arc::new(Mutex::new(Some(Box::new(on_end)))));
    let end: FloatTensor<Autodiff<K<B>>> = match End
        .prepare::<NoCheckpointing>([leaf.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, like.clone()),
        OpsKind::UnTracked(prep) => prep.finish(like.clone()),
    };
    let value = loss.primitive.clone();
    let joined: FloatTensor<Autodiff<K<B>>> = match Join
        .prepare::<NoCheckpointing>([loss.node.clone(), end.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(like.clone(), value),
        OpsKind::UnTracked(prep) => prep.finish(value),
    };
    Tensor::from_primitive(TensorPrimitive::Float(cast(joined)))
}

/// What a backward (`grads`, Burn autodiff's, during the pass or after it) left on the node of
/// a tap that did not run (`key`, [`Tapper::keys`]'s): a gradient sum seeded there (see
/// [`crate::train::grads::seed_with`]) that no op of the pass added to. Taken out of `grads`.
pub(crate) fn seeded_on<K: Backend>(
    grads: &mut Gradients,
    key: &FloatTensor<Autodiff<K>>,
) -> Option<FloatTensor<K>> {
    grads.remove::<K>(key)
}

/// The gradients a backward on `B` returned, as Burn's autodiff keeps them (`None` on another
/// autodiff backend, where there are no taps).
pub(crate) fn autodiff_grads<B: AutodiffBackend>(
    grads: &mut B::Gradients,
) -> Option<&mut Gradients> {
    let grads = (grads as &mut dyn std::any::Any).downcast_mut::<Gradients>();
    debug_assert!(
        grads.is_some() || !can_tap::<B>(),
        "Burn's autodiff returns its own gradients"
    );
    grads
}

/// Takes the values of the parameters in `ids` out of a model (each replaced by a one-element
/// placeholder): while backward runs, the model holds none of them, so that each weight can be
/// freed as soon as it has stepped.
pub(crate) struct Extract<'a, K: Backend> {
    ids: &'a [ParamId],
    /// The values taken, by id.
    pub(crate) values: HashMap<ParamId, FloatTensor<K>>,
}

impl<'a, K: Backend> Extract<'a, K> {
    pub(crate) fn new(ids: &'a [ParamId]) -> Self {
        Extract {
            ids,
            values: HashMap::new(),
        }
    }
}

impl<B: AutodiffBackend> ModuleMapper<B> for Extract<'_, B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !self.ids.contains(&id) {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let device = tensor.device();
        let dtype = tensor.dtype();
        self.values
            .entry(id)
            .or_insert_with(|| tensor.inner().into_primitive().tensor());
        let placeholder = Tensor::<B, D>::zeros([1; D], &device).cast(dtype);
        Param::from_mapped_value(id, placeholder, mapper)
    }
}

/// Puts values back into a model whose parameters [`Extract`] took, each a leaf that requires a
/// gradient.
pub(crate) struct Insert<'a, K: Backend> {
    pub(crate) values: &'a HashMap<ParamId, FloatTensor<K>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Insert<'_, B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(value) = self.values.get(&id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let inner =
            Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(value.clone()));
        Param::from_mapped_value(id, Tensor::from_inner(inner).require_grad(), mapper)
    }
}

/// A tapped model made plain again: each tapped parameter a leaf of the same value (the taps'
/// values are their parameters', no copy).
pub(crate) struct Untap<'a> {
    pub(crate) ids: &'a [ParamId],
}

impl<B: AutodiffBackend> ModuleMapper<B> for Untap<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !self.ids.contains(&id) {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        Param::from_mapped_value(
            id,
            Tensor::from_inner(tensor.inner()).require_grad(),
            mapper,
        )
    }
}
