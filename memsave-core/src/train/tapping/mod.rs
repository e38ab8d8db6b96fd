//! Taps on the trainable parameters for one backward pass, for the places of the optimizer's
//! step that use each gradient as soon as it is final (`hooks::optimizer::place`): the step in
//! backward (`step_in_backward = true`: each parameter steps as soon as backward has made its
//! final gradient, and the gradient is freed at once, so the whole set of gradients never
//! exists; PyTorch's optimizer hooks in backward, torchtune's `optimizer_in_bwd`, LOMO), and
//! ZeRO stage 2's reduction of each gradient to its owner.
//!
//! How, on Burn's autodiff: before the forward, every trainable parameter of the model the
//! forward runs on is replaced by a *tap* ([`crate::train::taps`]), a node whose backward step
//! runs once every use of the parameter has added its part, and hands the gradient over. Before
//! backward, the weights (and, under mixed precision, the fp32 masters and the half copy) are
//! taken out of the models into the pass's table, so that nothing else holds them: each
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
//! micro-batch steps in its backward; the earlier ones add up as without, or, under optimizer
//! offload, in an accumulation pass whose taps add each gradient to its sum on the host.

mod table;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use crate::parallel::in_backward::{take_sum, BackwardReduce, Tapped};
use crate::parallel::TapPeers;
use crate::train::grads;
use crate::train::optim::{HostState, HostSums};
use crate::train::taps::{self, DepthChain, Extract, Insert, Tapper, Untap};
use crate::train::{TrainModel, TrainState};
use crate::Result;
pub(crate) use table::Phase;
use table::{lock, Stepper, Table, TableInner, K};

/// How deep apart the taps of two consecutive parameters are (see [`crate::train::taps`]): more
/// than the ops between two parameters' first uses in the models memsave knows (a convolution,
/// its norm and activation, a residual add, an upsampling).
const TAP_GAP: usize = 24;

/// The taps of the current pass, and what is kept across iterations (the depth chain),
/// held by the run's state while a place of the optimizer's step uses them.
pub(crate) struct Tapping<B: AutodiffBackend> {
    chain: Option<DepthChain<K<B>>>,
    /// The pass under way: its table and the tapped parameters' ids (visiting order).
    pass: Option<(Arc<Table<B>>, Vec<ParamId>)>,
}

impl<B: AutodiffBackend> Default for Tapping<B> {
    fn default() -> Self {
        Tapping {
            chain: None,
            pass: None,
        }
    }
}

impl<B: AutodiffBackend> Tapping<B> {
    /// The phase of the pass under way.
    pub(crate) fn phase(&self) -> Option<Phase> {
        self.pass
            .as_ref()
            .map(|(table, _)| lock(&table.inner).phase)
    }

    /// Taps the model the forward runs on (`state.model`, or the half copy under mixed
    /// precision) for a pass of `phase`; with `peers`, each gradient is averaged over them as
    /// its tap hands it over.
    pub(crate) fn tap<M: TrainModel<B>>(
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
                store: None,
                forward: None,
                steps: None,
                lr: state.lr,
                unscale: None,
                coefficient: None,
                peers: None,
                kept: GradientsParams::new(),
                host_sums: None,
                device: device.clone(),
                keys: HashMap::new(),
            }),
        });
        let mut tapper = Tapper::<B, Table<B>>::new(chain, TAP_GAP, table.clone());
        match state.forward_model.take() {
            Some(forward) => state.forward_model = Some(forward.map(&mut tapper)),
            None => state.model = state.model.clone().map(&mut tapper),
        }
        let ids = std::mem::take(&mut tapper.ids);
        lock(&table.inner).keys = std::mem::take(&mut tapper.keys);
        if let Some(peers) = peers {
            let order = tapped_order::<B, M>(state.forward_model(), &ids);
            lock(&table.inner).peers = Some(BackwardReduce::new(peers, &device, order));
        }
        self.pass = Some((table, ids));
    }

    /// `loss` whose backward, with peers, ends by reducing the gradients whose taps did not
    /// run ([`taps::with_end`]): every all-reduce of the pass is made inside its backward.
    fn with_end(&self, loss: Tensor<B, 1>, table: &Arc<Table<B>>) -> Tensor<B, 1> {
        let (Some(chain), true) = (&self.chain, lock(&table.inner).peers.is_some()) else {
            return loss;
        };
        let table = table.clone();
        taps::with_end(loss, chain.like(), move |backward| {
            lock(&table.inner).end_peers(backward)
        })
    }

    /// The model the forward ran on made plain again (the pass is given up).
    pub(crate) fn untap<M: TrainModel<B>>(&mut self, state: &mut TrainState<B, M>) {
        let Some((_, ids)) = self.pass.take() else {
            return;
        };
        let mut untap = Untap { ids: &ids };
        match state.forward_model.take() {
            Some(forward) => state.forward_model = Some(forward.map(&mut untap)),
            None => state.model = state.model.clone().map(&mut untap),
        }
    }

    /// An accumulation pass (a micro-batch that does not end its group): backward of `loss`,
    /// each gradient added to its sum as soon as it is final and freed: on the host in `host`
    /// (optimizer offload), else on the device in `device` (fp32 sums of half gradients, under
    /// mixed precision: no whole set of half gradients is ever made beside the sums).
    pub(crate) fn accumulate_pass(
        &mut self,
        loss: Tensor<B, 1>,
        host: Option<&mut HostSums>,
        device: &mut Option<GradientsParams>,
    ) -> Result<()> {
        let (table, ids) = self.pass.take().expect("a pass was tapped");
        let mut host = host;
        {
            let mut inner = lock(&table.inner);
            match host.as_deref_mut() {
                Some(sums) => inner.host_sums = Some(std::mem::take(sums)),
                None => inner.sums = Some(device.take().unwrap_or_else(GradientsParams::new)),
            }
        }
        drop(loss.backward());
        let joined = crate::checkpoint::join_helpers();
        let mut inner = lock(&table.inner);
        match host {
            Some(sums) => *sums = inner.host_sums.take().unwrap_or_default(),
            None => *device = inner.sums.take(),
        }
        inner.reached.clear();
        drop(inner);
        self.pass = Some((table, ids));
        joined
    }

    /// A norm pass: backward of `loss` (the group's earlier gradients, `summed`, added: seeded
    /// in fp32, added as they come under mixed precision, and kept either way; or, under
    /// optimizer offload, those on the host, `host_sums`, added there); returns the global norm
    /// of the group's gradients (scaled as the loss was) and the parameters that got one.
    pub(crate) fn norm_pass<M: TrainModel<B>>(
        &mut self,
        state: &TrainState<B, M>,
        loss: Tensor<B, 1>,
        summed: Option<&GradientsParams>,
        mixed: bool,
        host_sums: Option<&mut HostSums>,
    ) -> Result<(Option<f64>, HashSet<ParamId>)> {
        let (table, ids) = self.pass.take().expect("a pass was tapped");
        let mut host_sums = host_sums;
        if let Some(sums) = host_sums.as_deref_mut() {
            lock(&table.inner).host_sums = Some(std::mem::take(sums));
        }
        let forward = state.forward_model();
        let loss = match summed {
            Some(sums) if mixed => {
                lock(&table.inner).sums = Some(grads::share::<B, M>(forward, sums));
                loss
            }
            Some(sums) => seed(loss, forward, grads::share::<B, M>(forward, sums)),
            None => loss,
        };
        let loss = self.with_end(loss, &table);
        let grads = loss.backward();
        let joined = crate::checkpoint::join_helpers();
        let mut inner = lock(&table.inner);
        let finished = joined.and(inner.finish_peers(forward));
        inner.finish_sums(forward, grads);
        let norm = finished.and_then(|()| inner.norm(forward, &state.device));
        let reached = std::mem::take(&mut inner.reached);
        inner.sums = None;
        if let (Some(sums), Some(kept)) = (host_sums, inner.host_sums.take()) {
            *sums = kept;
        }
        drop(inner);
        // The taps are spent; `untap` makes the model plain.
        self.pass = Some((table, ids));
        Ok((norm?, reached))
    }

    /// A reduce pass (data parallelism): backward of `loss` (the group's earlier gradients,
    /// `summed`, added as in [`Self::norm_pass`]), each gradient averaged over the peers as it
    /// is made and kept by its owner only. Returns the gradients this peer keeps and the
    /// parameters some peer had a gradient of.
    pub(crate) fn reduce_pass<M: TrainModel<B>>(
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
        let loss = self.with_end(loss, &table);
        drop(loss.backward());
        let joined = crate::checkpoint::join_helpers();
        let mut inner = lock(&table.inner);
        let finished = joined.and(inner.finish_peers(forward));
        let kept = std::mem::take(&mut inner.kept);
        let reached = std::mem::take(&mut inner.reached);
        inner.sums = None;
        drop(inner);
        self.pass = Some((table, ids));
        finished.map(|()| (kept, reached))
    }

    /// A step pass: backward of `loss` stepping every parameter as its gradient is final
    /// (`summed`: the group's earlier gradients), with the optimizer's state, or on the host
    /// with `host`'s (optimizer offload); `unscale` and `coefficient` prepare each gradient as
    /// the ordinary step does; `mixed`: under mixed precision (the sums added as the gradients
    /// come, not seeded). Returns the norm (when `log_norm`) and the parameters that got a
    /// gradient.
    pub(crate) fn step_pass<M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
        loss: Tensor<B, 1>,
        summed: Option<GradientsParams>,
        unscale: Option<f64>,
        coefficient: Option<f64>,
        mixed: bool,
        mut host: Option<&mut HostState>,
    ) -> Result<(Option<f64>, HashSet<ParamId>)> {
        let (table, ids) = self.pass.take().expect("a pass was tapped");
        // Seeding reads the tapped parameters' nodes: before the weights are taken out.
        let loss = match summed {
            Some(sums) if mixed => {
                lock(&table.inner).sums = Some(sums);
                loss
            }
            Some(sums) => seed(loss, state.forward_model(), sums),
            None => loss,
        };
        let loss = self.with_end(loss, &table);
        {
            let mut inner = lock(&table.inner);
            inner.lr = state.lr;
            inner.unscale = unscale;
            inner.coefficient = coefficient;
            inner.steps = Some(match host.as_deref_mut() {
                Some(host) => {
                    inner.host_sums = Some(host.take_sums());
                    Stepper::Host(host.take_steps())
                }
                None => Stepper::Device(state.optimizer.take_steps()),
            });
            inner.store = state.weights.take();
            let mut extract = Extract::new(&ids);
            state.model = state.model.clone().map(&mut extract);
            inner.weights = extract.values;
            if let Some(forward) = state.forward_model.take() {
                let mut extract = Extract::new(&ids);
                state.forward_model = Some(forward.map(&mut extract));
                inner.forward = Some(extract.values);
            }
        }
        let grads = loss.backward();
        let joined = crate::checkpoint::join_helpers();
        let mut inner = lock(&table.inner);
        let finished = joined.and(inner.finish_peers(&state.model));
        inner.finish_sums(&state.model, grads);
        inner.host_sums = None;
        match (inner.steps.take(), host) {
            (Some(Stepper::Device(steps)), _) => state.optimizer.put_back(steps),
            (Some(Stepper::Host(steps)), Some(host)) => host.put_back(steps),
            _ => {}
        }
        state.weights = inner.store.take();
        state.end_weight_step();
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
pub(crate) fn supported<B: AutodiffBackend>() -> bool {
    taps::can_tap::<B>()
}

/// The names of `model`'s trainable parameters that `reached` lacks (MMCV's
/// `detect_anomalous_params`).
pub(crate) fn missing<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    reached: &HashSet<ParamId>,
) -> Vec<String> {
    grads::params_without(model, &|id| reached.contains(&id))
}
