//! The step-in-backward part of the optimizer hook (`step_in_backward = true`): each parameter
//! steps as soon as backward has made its final gradient, and the gradient is freed at once,
//! so the whole set of gradients never exists (PyTorch's optimizer hooks in backward,
//! torchtune's `optimizer_in_bwd`, LOMO).
//!
//! How, on Burn's autodiff: before the forward, every trainable parameter of the model the
//! forward runs on is replaced by a *tap* ([`crate::train::taps`]), a node whose backward step
//! runs once every use of the parameter has added its part, and hands the gradient over. Before
//! backward, the weights (and, under mixed precision, the fp32 masters and the half copy) are
//! taken out of the models into this part's table, so that nothing else holds them: each
//! parameter's step replaces its old weight there, and the old one is freed then (Burn's
//! backward keeps a weight only until the ops that read it have run their backward, which is
//! before its tap). The optimizer's state is taken out of the optimizer the same way, stepped
//! parameter by parameter with the optimizer's own rule, and put back after backward.
//!
//! Exactness: each parameter's step is the ordinary step's arithmetic on the same tensors
//! (gradient, weight, state, learning rate): the same bits. What needs every gradient before
//! any step takes two passes (LOMO's answer): global-norm clipping, and the overflow check of
//! mixed precision. The first pass runs the forward and a backward that keeps only each
//! gradient's part of the norm (added in the model's order after backward: the ordinary norm's
//! bits) and frees the gradient; the second runs the forward again (the runner repeats it with
//! the same batch, dropout masks and batch statistics; running statistics move once) and a
//! backward that steps. An overflow skips the second pass. Under accumulation, the group's last
//! micro-batch steps in its backward; the earlier ones add up as without.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};

use crate::parallel::in_backward::{take_sum, BackwardReduce, Tapped};
use crate::parallel::zero::gather_norm;
use crate::parallel::TapPeers;
use crate::train::grads;
use crate::train::optim::ParamSteps;
use crate::train::taps::{self, DepthChain, Extract, Insert, Sink, Tapper, Untap};
use crate::train::{TrainModel, TrainState};
use crate::Result;

/// How deep apart the taps of two consecutive parameters are (see [`crate::train::taps`]): more
/// than the ops between two parameters' first uses in the models memsave knows (a convolution,
/// its norm and activation, a residual add, an upsampling).
const TAP_GAP: usize = 24;

/// What a pass's taps do with a gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Phase {
    /// Keep its part of the norm, free it (a first pass).
    Norm,
    /// Step its parameter with it.
    Step,
    /// Keep it (data parallelism: averaged over the peers first, and kept by its owner only).
    Reduce,
}

/// The table the taps of one pass share.
pub(super) struct Table<B: AutodiffBackend> {
    inner: Mutex<TableInner<B>>,
}

type K<B> = <B as AutodiffBackend>::InnerBackend;

struct TableInner<B: AutodiffBackend> {
    phase: Phase,
    norm_type: f64,
    /// The parts of the global norm, by parameter.
    parts: HashMap<ParamId, Tensor<K<B>, 1>>,
    /// Whether a step pass also keeps the parts (for the log's norm).
    log_norm: bool,
    /// The parameters whose tap received a gradient.
    reached: HashSet<ParamId>,
    /// Under mixed precision with accumulation: the group's fp32 sums, each micro-batch's half
    /// gradient added as it is made (kept by a norm pass, used up by a step pass).
    sums: Option<GradientsParams>,
    /// The weights stepped (the fp32 masters under mixed precision), taken out of the model.
    weights: HashMap<ParamId, FloatTensor<K<B>>>,
    /// Under mixed precision: the forward copy's values, taken out of it.
    forward: Option<HashMap<ParamId, FloatTensor<K<B>>>>,
    steps: Option<ParamSteps<B>>,
    lr: f64,
    /// Under mixed precision, `1 / loss_scale`: the gradients are cast to fp32 and unscaled.
    unscale: Option<f64>,
    /// The clipping coefficient (below 1), when the norm is over `max_norm`.
    coefficient: Option<f64>,
    /// Data parallelism: each gradient averaged over the peers as its tap hands it over.
    peers: Option<BackwardReduce<K<B>>>,
    /// A reduce pass's gradients (those this peer keeps).
    kept: GradientsParams,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<B: AutodiffBackend> Sink<K<B>> for Table<B> {
    fn on_grad<const D: usize>(&self, id: ParamId, grad: Tensor<K<B>, D>) {
        let mut table = lock(&self.inner);
        let table = &mut *table;
        table.reached.insert(id);
        // A norm pass keeps the group's sums for the step pass.
        let keep = table.phase == Phase::Norm;
        let grad = match &mut table.sums {
            // Mixed precision with accumulation: the group's sum with this micro-batch's part.
            Some(sums) => {
                let sum = if keep {
                    sums.get::<K<B>, D>(id)
                } else {
                    sums.remove::<K<B>, D>(id)
                };
                grads::add_to_sum(sum, grad)
            }
            None => grad,
        };
        let grad = match &mut table.peers {
            Some(peers) => match peers.reduce(id, grad, table.sums.as_mut(), keep) {
                Some(mean) => mean,
                // Another peer's part, or the pass failed (said after backward).
                None => return,
            },
            None => grad,
        };
        table.use_grad(id, grad);
    }
}

impl<B: AutodiffBackend> TableInner<B> {
    /// What the pass does with parameter `id`'s final gradient (averaged over the peers).
    fn use_grad<const D: usize>(&mut self, id: ParamId, grad: Tensor<K<B>, D>) {
        if self.phase == Phase::Reduce {
            self.kept.register::<K<B>, D>(id, grad);
            return;
        }
        if self.phase == Phase::Norm || self.log_norm {
            let part = grads::norm_part(grad.clone(), self.norm_type);
            self.parts.insert(id, part);
        }
        if self.phase == Phase::Norm {
            return;
        }
        // The ordinary step's preparation (`grads::to_f32`, `grads::scale`), then its step.
        let mut grad = grad;
        if let Some(unscale) = self.unscale {
            grad = grad.cast(DType::F32).mul_scalar(unscale);
        }
        if let Some(coefficient) = self.coefficient {
            grad = grad.mul_scalar(coefficient);
        }
        let Some(weight) = self.weights.remove(&id) else {
            return;
        };
        let weight = Tensor::<K<B>, D>::from_primitive(TensorPrimitive::Float(weight));
        let steps = self
            .steps
            .as_mut()
            .expect("a step pass holds the optimizer's steps");
        let lr = self.lr;
        let stepped = crate::memory::scope(crate::memory::phase::STEP, || {
            steps.step::<D>(lr, id, weight, grad)
        });
        if let Some(forward) = &mut self.forward {
            // The forward copy as `wrap_fp16_model` makes it: cast where it was cast.
            if let Some(old) = forward.remove(&id) {
                let old = Tensor::<K<B>, D>::from_primitive(TensorPrimitive::Float(old));
                let value = if old.dtype() == stepped.dtype() {
                    stepped.clone()
                } else {
                    crate::memory::scope(crate::memory::phase::HALF_WEIGHTS, || {
                        stepped.clone().cast(old.dtype())
                    })
                };
                drop(old);
                forward.insert(id, value.into_primitive().tensor());
            }
        }
        self.weights.insert(id, stepped.into_primitive().tensor());
    }

    /// After backward with peers: the gradients whose taps did not run are reduced, `reached`
    /// becomes the parameters some peer had a gradient of, and the means this peer keeps but
    /// had no gradient of are used (`model`: any model with the tapped parameters' ids).
    fn finish_peers<M: AutodiffModule<B>>(&mut self, model: &M) -> Result<()> {
        let Some(peers) = &mut self.peers else {
            return Ok(());
        };
        let keep = self.phase == Phase::Norm;
        let (reached, deferred) = peers.finish(self.sums.as_mut(), keep)?;
        self.reached = reached;
        struct UseDeferred<'a, B: AutodiffBackend> {
            table: &'a mut TableInner<B>,
            deferred: HashMap<ParamId, FloatTensor<K<B>>>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for UseDeferred<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(mean) = self.deferred.remove(&param.id) {
                    let mean = Tensor::<K<B>, D>::from_primitive(TensorPrimitive::Float(mean));
                    self.table.use_grad::<D>(param.id, mean);
                }
            }
        }
        if !deferred.is_empty() {
            model.visit(&mut UseDeferred {
                table: self,
                deferred,
            });
        }
        Ok(())
    }

    /// The global norm of the pass's parts, added in `model`'s visiting order (gathered from
    /// their owners where each peer holds its part).
    fn norm<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        device: &burn::tensor::Device<K<B>>,
    ) -> Result<Option<f64>> {
        let norm_type = self.norm_type;
        match &self.peers {
            Some(peers) if peers.sharded() => {
                let parts = in_model_order(model, &mut self.parts);
                gather_norm(peers.collective(), parts, norm_type, device)
            }
            _ => Ok(combine(model, &mut self.parts, norm_type)),
        }
    }
}

/// The part's state across iterations, and the current pass's.
pub(super) struct InBackward<B: AutodiffBackend> {
    chain: Option<DepthChain<K<B>>>,
    /// The pass under way: its table and the tapped parameters' ids (visiting order).
    pass: Option<(Arc<Table<B>>, Vec<ParamId>)>,
    /// The norm a first pass found (unscaled), for the second.
    norm: Option<f64>,
}

impl<B: AutodiffBackend> Default for InBackward<B> {
    fn default() -> Self {
        InBackward {
            chain: None,
            pass: None,
            norm: None,
        }
    }
}

impl<B: AutodiffBackend> InBackward<B> {
    /// Whether this iteration's forward runs on tapped parameters.
    pub(super) fn active(&self) -> bool {
        self.pass.is_some()
    }

    /// The phase of the pass under way.
    pub(super) fn phase(&self) -> Option<Phase> {
        self.pass
            .as_ref()
            .map(|(table, _)| lock(&table.inner).phase)
    }

    /// Taps the model the forward runs on (`state.model`, or the half copy under mixed
    /// precision) for a pass of `phase`; with `peers`, each gradient is averaged over them as
    /// its tap hands it over.
    pub(super) fn tap<M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
        phase: Phase,
        norm_type: f64,
        log_norm: bool,
        peers: Option<TapPeers<K<B>>>,
    ) {
        let device = state.device.clone();
        let chain = self.chain.get_or_insert_with(|| DepthChain::new(&device));
        let table = Arc::new(Table {
            inner: Mutex::new(TableInner {
                phase,
                norm_type,
                parts: HashMap::new(),
                log_norm,
                reached: HashSet::new(),
                sums: None,
                weights: HashMap::new(),
                forward: None,
                steps: None,
                lr: state.lr,
                unscale: None,
                coefficient: None,
                peers: None,
                kept: GradientsParams::new(),
            }),
        });
        let mut tapper = Tapper::<B, Table<B>>::new(chain, TAP_GAP, table.clone());
        match state.forward_model.take() {
            Some(forward) => state.forward_model = Some(forward.map(&mut tapper)),
            None => state.model = state.model.clone().map(&mut tapper),
        }
        let ids = std::mem::take(&mut tapper.ids);
        if let Some(peers) = peers {
            let order = tapped_order::<B, M>(state.forward_model(), &ids);
            lock(&table.inner).peers = Some(BackwardReduce::new(peers, &device, order));
        }
        self.pass = Some((table, ids));
    }

    /// The model the forward ran on made plain again (the pass is given up).
    pub(super) fn untap<M: TrainModel<B>>(&mut self, state: &mut TrainState<B, M>) {
        let Some((_, ids)) = self.pass.take() else {
            return;
        };
        let mut untap = Untap { ids: &ids };
        match state.forward_model.take() {
            Some(forward) => state.forward_model = Some(forward.map(&mut untap)),
            None => state.model = state.model.clone().map(&mut untap),
        }
    }

    /// A norm pass: backward of `loss` (the group's earlier gradients, `summed`, added: seeded
    /// in fp32, added as they come under mixed precision, and kept either way); returns the
    /// global norm of the group's gradients (scaled as the loss was) and the parameters that
    /// got one.
    pub(super) fn norm_pass<M: TrainModel<B>>(
        &mut self,
        state: &TrainState<B, M>,
        loss: Tensor<B, 1>,
        summed: Option<&GradientsParams>,
        mixed: bool,
    ) -> Result<(Option<f64>, HashSet<ParamId>)> {
        let (table, ids) = self.pass.take().expect("a pass was tapped");
        let forward = state.forward_model();
        let loss = match summed {
            Some(sums) if mixed => {
                lock(&table.inner).sums = Some(grads::share::<B, M>(forward, sums));
                loss
            }
            Some(sums) => seed(loss, forward, grads::share::<B, M>(forward, sums)),
            None => loss,
        };
        drop(loss.backward());
        crate::checkpoint::join_helpers();
        let mut inner = lock(&table.inner);
        let finished = inner.finish_peers(forward);
        let norm = finished.and_then(|()| inner.norm(forward, &state.device));
        let reached = std::mem::take(&mut inner.reached);
        inner.sums = None;
        drop(inner);
        // The taps are spent; `untap` makes the model plain.
        self.pass = Some((table, ids));
        Ok((norm?, reached))
    }

    /// A reduce pass (data parallelism): backward of `loss` (the group's earlier gradients,
    /// `summed`, added as in [`Self::norm_pass`]), each gradient averaged over the peers as it
    /// is made and kept by its owner only. Returns the gradients this peer keeps and the
    /// parameters some peer had a gradient of.
    pub(super) fn reduce_pass<M: TrainModel<B>>(
        &mut self,
        state: &TrainState<B, M>,
        loss: Tensor<B, 1>,
        summed: Option<GradientsParams>,
        mixed: bool,
    ) -> Result<(GradientsParams, HashSet<ParamId>)> {
        let (table, ids) = self.pass.take().expect("a pass was tapped");
        let forward = state.forward_model();
        let loss = match summed {
            Some(sums) if mixed => {
                lock(&table.inner).sums = Some(sums);
                loss
            }
            Some(sums) => seed(loss, forward, sums),
            None => loss,
        };
        drop(loss.backward());
        crate::checkpoint::join_helpers();
        let mut inner = lock(&table.inner);
        let finished = inner.finish_peers(forward);
        let kept = std::mem::take(&mut inner.kept);
        let reached = std::mem::take(&mut inner.reached);
        inner.sums = None;
        drop(inner);
        self.pass = Some((table, ids));
        finished.map(|()| (kept, reached))
    }

    /// Keeps the norm a first pass found for the second.
    pub(super) fn set_norm(&mut self, norm: Option<f64>) {
        self.norm = norm;
    }

    /// The norm the first pass found.
    pub(super) fn norm(&self) -> Option<f64> {
        self.norm
    }

    /// A step pass: backward of `loss` stepping every parameter as its gradient is final
    /// (`summed`: the group's earlier gradients); `unscale` and `coefficient` prepare each
    /// gradient as the ordinary step does. Returns the norm (when `log_norm`) and the
    /// parameters that got a gradient.
    pub(super) fn step_pass<M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
        loss: Tensor<B, 1>,
        summed: Option<GradientsParams>,
        unscale: Option<f64>,
        coefficient: Option<f64>,
    ) -> Result<(Option<f64>, HashSet<ParamId>)> {
        let (table, ids) = self.pass.take().expect("a pass was tapped");
        let mixed = state.forward_model.is_some();
        // Seeding reads the tapped parameters' nodes: before the weights are taken out.
        let loss = match summed {
            Some(sums) if mixed => {
                lock(&table.inner).sums = Some(sums);
                loss
            }
            Some(sums) => seed(loss, state.forward_model(), sums),
            None => loss,
        };
        {
            let mut inner = lock(&table.inner);
            inner.lr = state.lr;
            inner.unscale = unscale;
            inner.coefficient = coefficient;
            inner.steps = Some(state.optimizer.take_steps());
            let mut extract = Extract::new(&ids);
            state.model = state.model.clone().map(&mut extract);
            inner.weights = extract.values;
            if let Some(forward) = state.forward_model.take() {
                let mut extract = Extract::new(&ids);
                state.forward_model = Some(forward.map(&mut extract));
                inner.forward = Some(extract.values);
            }
        }
        drop(loss.backward());
        crate::checkpoint::join_helpers();
        let mut inner = lock(&table.inner);
        let finished = inner.finish_peers(&state.model);
        if let Some(steps) = inner.steps.take() {
            state.optimizer.put_back(steps);
        }
        let weights = std::mem::take(&mut inner.weights);
        state.model = state.model.clone().map(&mut Insert { values: &weights });
        drop(weights);
        if let Some(values) = inner.forward.take() {
            if let Some(forward) = state.forward_model.take() {
                state.forward_model = Some(forward.map(&mut Insert { values: &values }));
            }
        }
        finished?;
        let norm = if inner.log_norm {
            inner.norm(&state.model, &state.device)?
        } else {
            None
        };
        let reached = std::mem::take(&mut inner.reached);
        Ok((norm, reached))
    }
}

/// `loss` whose backward starts from the sums (see [`grads::backward`]).
fn seed<B: AutodiffBackend, M: AutodiffModule<B>>(
    loss: Tensor<B, 1>,
    model: &M,
    sums: GradientsParams,
) -> Tensor<B, 1> {
    let (loss, leftover) = grads::seed_with::<B, M>(loss, model, sums);
    debug_assert!(
        leftover.is_none(),
        "taps exist on Burn's autodiff only, whose nodes can be seeded"
    );
    loss
}

/// The global norm of the `parts`, added in `model`'s visiting order.
fn combine<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    parts: &mut HashMap<ParamId, Tensor<K<B>, 1>>,
    norm_type: f64,
) -> Option<f64> {
    struct Order<'a, K: Backend> {
        parts: &'a mut HashMap<ParamId, Tensor<K, 1>>,
        ordered: Vec<Tensor<K, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Order<'_, B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(part) = self.parts.remove(&param.id) {
                self.ordered.push(part);
            }
        }
    }
    let mut order = Order {
        parts,
        ordered: Vec::new(),
    };
    model.visit(&mut order);
    grads::combine_norm(order.ordered, norm_type)
}

/// The parts of the float parameters of `model`, in its visiting order (`None` where this peer
/// has none).
fn in_model_order<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    parts: &mut HashMap<ParamId, Tensor<K<B>, 1>>,
) -> Vec<Option<Tensor<K<B>, 1>>> {
    struct Order<'a, K: Backend> {
        parts: &'a mut HashMap<ParamId, Tensor<K, 1>>,
        ordered: Vec<Option<Tensor<K, 1>>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Order<'_, B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.ordered.push(self.parts.remove(&param.id));
        }
    }
    let mut order = Order {
        parts,
        ordered: Vec::new(),
    };
    model.visit(&mut order);
    order.ordered
}

/// The tapped parameters `ids` of `model` in its visiting order, with their shapes and
/// precisions (for [`BackwardReduce`]).
fn tapped_order<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    ids: &[ParamId],
) -> Vec<Tapped<K<B>>> {
    struct Collect<'a, K: Backend> {
        ids: &'a [ParamId],
        found: HashMap<ParamId, Tapped<K>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.ids.contains(&param.id) && !self.found.contains_key(&param.id) {
                self.found.insert(
                    param.id,
                    Tapped {
                        id: param.id,
                        shape: param.lazy_shape(),
                        dtype: param.val().dtype(),
                        take_sum: take_sum::<B::InnerBackend, D>,
                    },
                );
            }
        }
    }
    let mut collect = Collect {
        ids,
        found: HashMap::new(),
    };
    model.visit(&mut collect);
    ids.iter()
        .filter_map(|id| collect.found.remove(id))
        .collect()
}

/// Whether the step in backward can run on the backend `B`.
pub(super) fn supported<B: AutodiffBackend>() -> bool {
    taps::can_tap::<B>()
}

/// The names of `model`'s trainable parameters that `reached` lacks (MMCV's
/// `detect_anomalous_params`).
pub(super) fn missing<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    reached: &HashSet<ParamId>,
) -> Vec<String> {
    grads::params_without(model, &|id| reached.contains(&id))
}
