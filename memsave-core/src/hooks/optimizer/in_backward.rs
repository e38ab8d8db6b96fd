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

use crate::train::grads;
use crate::train::optim::ParamSteps;
use crate::train::taps::{self, DepthChain, Extract, Insert, Sink, Tapper, Untap};
use crate::train::{TrainModel, TrainState};

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
        let grad = match &mut table.sums {
            // Mixed precision with accumulation: the group's sum with this micro-batch's part.
            Some(sums) => {
                let sum = match table.phase {
                    Phase::Norm => sums.get::<K<B>, D>(id),
                    Phase::Step => sums.remove::<K<B>, D>(id),
                };
                grads::add_to_sum(sum, grad)
            }
            None => grad,
        };
        if table.phase == Phase::Norm || table.log_norm {
            let part = grads::norm_part(grad.clone(), table.norm_type);
            table.parts.insert(id, part);
        }
        if table.phase == Phase::Norm {
            return;
        }
        // The ordinary step's preparation (`grads::to_f32`, `grads::scale`), then its step.
        let mut grad = grad;
        if let Some(unscale) = table.unscale {
            grad = grad.cast(DType::F32).mul_scalar(unscale);
        }
        if let Some(coefficient) = table.coefficient {
            grad = grad.mul_scalar(coefficient);
        }
        let Some(weight) = table.weights.remove(&id) else {
            return;
        };
        let weight = Tensor::<K<B>, D>::from_primitive(TensorPrimitive::Float(weight));
        let steps = table
            .steps
            .as_mut()
            .expect("a step pass holds the optimizer's steps");
        let lr = table.lr;
        let stepped = crate::memory::scope(crate::memory::phase::STEP, || {
            steps.step::<D>(lr, id, weight, grad)
        });
        if let Some(forward) = &mut table.forward {
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
        table.weights.insert(id, stepped.into_primitive().tensor());
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
    /// precision) for a pass of `phase`.
    pub(super) fn tap<M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
        phase: Phase,
        norm_type: f64,
        log_norm: bool,
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
            }),
        });
        let mut tapper = Tapper::<B, Table<B>>::new(chain, TAP_GAP, table.clone());
        match state.forward_model.take() {
            Some(forward) => state.forward_model = Some(forward.map(&mut tapper)),
            None => state.model = state.model.clone().map(&mut tapper),
        }
        let ids = std::mem::take(&mut tapper.ids);
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
    ) -> (Option<f64>, HashSet<ParamId>) {
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
        let norm_type = inner.norm_type;
        let norm = combine(forward, &mut inner.parts, norm_type);
        let reached = std::mem::take(&mut inner.reached);
        inner.sums = None;
        drop(inner);
        // The taps are spent; `untap` makes the model plain.
        self.pass = Some((table, ids));
        (norm, reached)
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
    ) -> (Option<f64>, HashSet<ParamId>) {
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
        let norm = if inner.log_norm {
            let norm_type = inner.norm_type;
            combine(&state.model, &mut inner.parts, norm_type)
        } else {
            None
        };
        let reached = std::mem::take(&mut inner.reached);
        (norm, reached)
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
