//! Taps on Burn 0.22: a node in front of each trainable parameter whose backward step runs as
//! soon as the parameter's gradient is final and hands it to a [`Sink`] (PyTorch's
//! `register_post_accumulate_grad_hook`), so that the optimizer can step that parameter during
//! backward and free its gradient at once.
//!
//! ```text
//!   w (leaf) ─────► tap ─────► every use of w in the forward (a conv, a matmul, an anchor)
//!                    ▲
//!   depth[k] ········┘   untracked: deepens the tap, adds no edge
//! ```
//!
//! Burn 0.22 runs backward steps by descending order (burn-autodiff `runtime/server.rs`: the
//! tape bucketed by `step.depth()`), a node's order being one more than the highest of *all* its
//! parents', untracked ones included (`tensor.rs`, `from_parents`; only the parents list drops
//! them), so a tap runs after every use of its parameter: its gradient is final then. A tap over
//! the leaf alone would be of order 1 and run last of all, when every gradient exists anyway,
//! so its second parent is an untracked node of a chosen order: it adds no edge (no gradient
//! flows to it, no step runs for it) but counts in the order. The `k`-th trainable parameter in
//! the model's visiting order gets order `k * gap + 2`, `gap` larger than the ops between two
//! parameters' first uses: backward then runs the model's ops and taps in the reverse of the
//! visiting order, each tap right after the backward of the part of the model from its
//! parameter's first use on. Where the visiting order is not the forward's, a tap runs later
//! than it could, never before its gradient is final.
//!
//! The untracked nodes that set the orders are Burn's own ops on a one-element tensor (each one
//! more), made once per [`DepthChain`] and kept; each step adds one tap per trainable parameter.
//! A tap's step uses plain tensors only (Burn runs steps under its graph's lock); a parameter
//! held twice (one `ParamId`, tied weights) gets one tap. A tap is one of memsave's nodes
//! (`checkpoint::ours`): a segment whose recomputation does not reach its parameter tells it
//! "none", and the sink is not called, as a plain backward gives that parameter no gradient.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::{DispatchTensor, TensorMetadata};
use burn::module::{ModuleMapper, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{GradientCheckpointingStrategy, Shape};

use crate::backend::{self, on_backend, AdTensor, DispatchBackend, OnBackend};
use crate::checkpoint::{nodes, ours};

/// Where a tap hands its parameter's final gradient.
pub(crate) trait Sink: Send + Sync + 'static {
    /// `grad` is the final gradient of the parameter `id` (a plain tensor of rank `D`).
    fn on_grad<const D: usize>(&self, id: ParamId, grad: Tensor<D>);
}

/// Untracked one-element tensors of the orders the taps ask for: their second parents. A node of
/// order `d` is made by `d` ops from a fresh leaf; only the nodes asked for are kept (one per
/// tapped parameter, reused every step), the ops between them freed.
pub(crate) struct DepthChain {
    device: Device,
    nodes: BTreeMap<usize, Tensor<1>>,
}

impl DepthChain {
    /// An empty chain on `device` (an autodiff device).
    pub(crate) fn new(device: &Device) -> Self {
        DepthChain {
            device: device.clone(),
            nodes: BTreeMap::new(),
        }
    }

    /// The node of order `depth`, made (and kept) if it is not there.
    fn at(&mut self, depth: usize) -> Tensor<1> {
        if let Some(node) = self.nodes.get(&depth) {
            return node.clone();
        }
        let (mut node, mut reached) = match self.nodes.range(..depth).next_back() {
            Some((&reached, node)) => (node.clone(), reached),
            None => (Tensor::<1>::zeros([1], &self.device), 0),
        };
        while reached < depth {
            node = node.add_scalar(0.0);
            reached += 1;
        }
        self.nodes.insert(depth, node.clone());
        node
    }
}

type OnGrad = Box<dyn FnOnce(DispatchTensor) + Send>;

/// A tap's state: the call that hands the gradient over (taken once) and the parameter's shape
/// (a gradient of another shape is a segment's mark of "none").
struct TapState {
    on_grad: Arc<Mutex<Option<OnGrad>>>,
    shape: Shape,
}

impl Clone for TapState {
    fn clone(&self) -> Self {
        TapState {
            on_grad: self.on_grad.clone(),
            shape: self.shape.clone(),
        }
    }
}

impl std::fmt::Debug for TapState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TapState")
    }
}

/// The tap: its output is its parameter's value; its step hands the gradient its output
/// received (the parameter's, whole) to the sink and passes nothing on.
#[derive(Debug)]
struct Tap;

impl<B: DispatchBackend> Backward<B, 2> for Tap {
    type State = TapState;

    fn backward(self, ops: Ops<TapState, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if grad.shape() != ops.state.shape {
            return;
        }
        let on_grad = nodes::lock(&ops.state.on_grad).take();
        if let Some(on_grad) = on_grad {
            on_grad(B::from_plain(grad));
        }
    }
}

/// Makes the tap of `leaf` over the chain node `depth` (both autodiff dispatch tensors).
struct MakeTap {
    leaf: DispatchTensor,
    depth: DispatchTensor,
    state: TapState,
}

impl OnBackend for MakeTap {
    type Output = DispatchTensor;

    fn run<B: DispatchBackend>(
        self,
        strategy: Option<GradientCheckpointingStrategy>,
    ) -> Self::Output {
        let strategy = strategy.expect("a tapped parameter is tracked");
        let leaf = B::autodiff_of(self.leaf);
        let depth = B::autodiff_of(self.depth);
        let tapped = match strategy {
            GradientCheckpointingStrategy::Balanced => {
                tap::<B, BalancedCheckpointing>(&leaf, &depth, self.state)
            }
            _ => tap::<B, NoCheckpointing>(&leaf, &depth, self.state),
        };
        ours::insert(tapped.id());
        B::from_autodiff(tapped, strategy)
    }
}

fn tap<B: DispatchBackend, C: CheckpointStrategy>(
    leaf: &AdTensor<B>,
    depth: &AdTensor<B>,
    state: TapState,
) -> AdTensor<B> {
    nodes::node::<B, C, Tap, 2>(Tap, [leaf, depth], state, leaf.primitive().clone())
}

/// Replaces every trainable float parameter of a model by its tap (see the module docs); the
/// tapped parameters' ids, in visiting order, are in `ids`.
pub(crate) struct Tapper<'a, S: Sink> {
    chain: &'a mut DepthChain,
    gap: usize,
    sink: Arc<S>,
    /// A parameter held twice (one `ParamId`) gets one tap.
    seen: HashMap<ParamId, DispatchTensor>,
    /// The tapped parameters, in visiting order.
    pub(crate) ids: Vec<ParamId>,
}

impl<'a, S: Sink> Tapper<'a, S> {
    /// Taps handing gradients to `sink`, `gap` deep apart (at least 1).
    pub(crate) fn new(chain: &'a mut DepthChain, gap: usize, sink: Arc<S>) -> Self {
        Tapper {
            chain,
            gap: gap.max(1),
            sink,
            seen: HashMap::new(),
            ids: Vec::new(),
        }
    }
}

impl<S: Sink> ModuleMapper for Tapper<'_, S> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let dispatch = tensor.clone().into_dispatch();
        if !backend::is_autodiff_float(&dispatch)
            || !tensor.is_require_grad()
            || backend::supported(&dispatch).is_err()
        {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        if let Some(tapped) = self.seen.get(&id) {
            return Param::from_mapped_value(id, Tensor::from_dispatch(tapped.clone()), mapper);
        }
        let depth = self.ids.len() * self.gap + 1;
        let sink = self.sink.clone();
        let on_grad: OnGrad =
            Box::new(move |grad| sink.on_grad::<D>(id, Tensor::from_dispatch(grad)));
        let state = TapState {
            on_grad: Arc::new(Mutex::new(Some(on_grad))),
            shape: dispatch.shape(),
        };
        let make = MakeTap {
            leaf: dispatch.clone(),
            depth: self.chain.at(depth).into_dispatch(),
            state,
        };
        let tapped = on_backend(&dispatch, make).expect("the backend was checked");
        self.seen.insert(id, tapped.clone());
        self.ids.push(id);
        Param::from_mapped_value(id, Tensor::from_dispatch(tapped), mapper)
    }
}

/// A tapped model made plain again: each tapped parameter a leaf of the same value (the taps'
/// values are their parameters', no copy), requiring a gradient.
pub(crate) struct Untap<'a> {
    pub(crate) ids: &'a [ParamId],
}

impl ModuleMapper for Untap<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        if !self.ids.contains(&id) {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let strategy = tensor.gradient_checkpointing_strategy();
        let mut leaf = Tensor::from_inner(tensor.inner());
        if let Some(strategy) = strategy {
            leaf = leaf.with_gradient_checkpointing_strategy(strategy);
        }
        Param::from_mapped_value(id, leaf.require_grad(), mapper)
    }
}
