//! The table the taps of one pass share: what each gradient is used for (a part of the norm,
//! a step, kept for its owner), the weights and optimizer steps taken out of the model while
//! backward runs, the group's sums, and the peers each gradient is averaged over.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use burn::backend::autodiff::grads::Gradients;
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};

use crate::parallel::in_backward::{BackwardReduce, Earlier};
use crate::parallel::zero::gather_norm;
use crate::train::grads;
use crate::train::optim::{prepare, Host, HostSteps, HostSums, ParamSteps};
use crate::train::taps::{self, Sink};
use crate::Result;

/// What a pass's taps do with a gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Phase {
    /// Keep its part of the norm, free it (a first pass).
    Norm,
    /// Step its parameter with it.
    Step,
    /// Keep it (data parallelism: averaged over the peers first, and kept by its owner only).
    Reduce,
    /// Add it to its sum, free it (a micro-batch that does not end its group: on the host under
    /// optimizer offload, else on the device under mixed precision).
    Accumulate,
}

/// The table the taps of one pass share.
pub(crate) struct Table<B: AutodiffBackend> {
    pub(super) inner: Mutex<TableInner<B>>,
}

pub(crate) type K<B> = <B as AutodiffBackend>::InnerBackend;

pub(super) struct TableInner<B: AutodiffBackend> {
    pub(super) phase: Phase,
    pub(super) norm_type: f64,
    /// The parts of the global norm, by parameter.
    pub(super) parts: HashMap<ParamId, Tensor<K<B>, 1>>,
    /// Whether a step pass also keeps the parts (for the log's norm).
    pub(super) log_norm: bool,
    /// The parameters whose tap received a gradient.
    pub(super) reached: HashSet<ParamId>,
    /// Under mixed precision with accumulation: the group's fp32 sums, each micro-batch's half
    /// gradient added as it is made (kept by a norm pass, used up by a step pass).
    pub(super) sums: Option<GradientsParams>,
    /// The weights stepped (the fp32 masters under mixed precision), taken out of the model.
    pub(super) weights: HashMap<ParamId, FloatTensor<K<B>>>,
    /// With 16-bit weights: the run's store, which rounds each stepped value back.
    pub(super) store: Option<crate::train::weights::WeightStore<K<B>>>,
    /// Under mixed precision: the forward copy's values, taken out of it.
    pub(super) forward: Option<HashMap<ParamId, FloatTensor<K<B>>>>,
    /// The optimizer's steps during a step pass: on the device, or on the host.
    pub(super) steps: Option<Stepper<B>>,
    pub(super) lr: f64,
    /// Under mixed precision, `1 / loss_scale`: the gradients are cast to fp32 and unscaled.
    pub(super) unscale: Option<f64>,
    /// The clipping coefficient (below 1), when the norm is over `max_norm`.
    pub(super) coefficient: Option<f64>,
    /// Data parallelism: each gradient averaged over the peers as its tap hands it over.
    pub(super) peers: Option<BackwardReduce<K<B>>>,
    /// A reduce pass's gradients (those this peer keeps).
    pub(super) kept: GradientsParams,
    /// Under optimizer offload: the group's sums in host memory.
    pub(super) host_sums: Option<HostSums>,
    /// The device the pass runs on (where the host's parts of the norm go).
    pub(super) device: burn::tensor::Device<K<B>>,
    /// Each tap's node ([`crate::train::taps::Tapper::keys`]).
    pub(super) keys: HashMap<ParamId, FloatTensor<Autodiff<K<B>>>>,
}

/// Where a step pass steps each parameter: with the optimizer's state on the device, or with
/// the state and fp32 master in host memory (optimizer offload).
pub(super) enum Stepper<B: AutodiffBackend> {
    Device(ParamSteps<B>),
    Host(HostSteps),
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<B: AutodiffBackend> Sink<K<B>> for Table<B> {
    fn on_grad<const D: usize>(
        &self,
        id: ParamId,
        grad: Tensor<K<B>, D>,
        backward: &mut Gradients,
    ) {
        let mut table = lock(&self.inner);
        let table = &mut *table;
        table.reached.insert(id);
        // Optimizer offload: the group's sums on the host (training alone).
        if let Some(sums) = &mut table.host_sums {
            match table.phase {
                Phase::Accumulate => return sums.add(id, grad),
                Phase::Norm if !sums.is_empty() => {
                    let grad = sums.with(id, grad, true);
                    return table.host_norm_part(id, grad);
                }
                Phase::Step if !sums.is_empty() => {
                    let grad = sums.with(id, grad, false);
                    return table.step_on_host(id, grad, true);
                }
                _ => {}
            }
        }
        // A micro-batch that does not end its group, the sums on the device: added to its fp32
        // sum as `grads::accumulate` adds; the group's first kept as it is (half: cast after
        // backward, as the untapped pass casts, so that no fp32 set grows while the forward's
        // activations are live).
        if table.phase == Phase::Accumulate {
            let sums = table.sums.get_or_insert_with(GradientsParams::new);
            let sum = grads::add_to_sum(sums.remove::<K<B>, D>(id), grad);
            sums.register::<K<B>, D>(id, sum);
            return;
        }
        // A norm pass keeps the group's sums for the step pass.
        let keep = table.phase == Phase::Norm;
        let grad = match &mut table.sums {
            // Mixed precision with accumulation: the group's sum with this micro-batch's part,
            // in fp32 (where no earlier micro-batch reached the parameter too, as the
            // ordinary step's group is: another peer's sum of it is fp32).
            Some(sums) => {
                let sum = if keep {
                    sums.get::<K<B>, D>(id)
                } else {
                    sums.remove::<K<B>, D>(id)
                };
                match sum {
                    Some(sum) => grads::add_to_sum(Some(sum), grad),
                    None => grad.cast(DType::F32),
                }
            }
            None => grad,
        };
        let grad = match &mut table.peers {
            Some(peers) => {
                let mut earlier = earlier::<B>(table.sums.as_mut(), &table.keys, backward, keep);
                match peers.reduce(id, grad, &mut earlier) {
                    Some(mean) => mean,
                    // Another peer's part, or the pass failed (said after backward).
                    None => return,
                }
            }
            None => grad,
        };
        table.use_grad(id, grad);
    }
}

impl<B: AutodiffBackend> TableInner<B> {
    /// What the pass does with parameter `id`'s final gradient (averaged over the peers).
    fn use_grad<const D: usize>(&mut self, id: ParamId, grad: Tensor<K<B>, D>) {
        match self.phase {
            Phase::Reduce => return self.kept.register::<K<B>, D>(id, grad),
            // Added to its sum in `on_grad` (not reached).
            Phase::Accumulate => return,
            Phase::Step if matches!(self.steps, Some(Stepper::Host(_))) => {
                // The log's part of the norm on the device, where the whole gradient is, as
                // without offload.
                if self.log_norm {
                    let part = grads::norm_part(grad.clone(), self.norm_type);
                    self.parts.insert(id, part);
                }
                return self.step_on_host(id, crate::train::optim::to_host(grad), false);
            }
            Phase::Norm | Phase::Step => {}
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
        let Some(Stepper::Device(steps)) = self.steps.as_mut() else {
            unreachable!("a step pass holds the optimizer's steps");
        };
        let lr = self.lr;
        let store = self.store.as_mut();
        let stepped = crate::memory::scope(crate::memory::phase::STEP, || match store {
            None => steps.step::<D>(lr, id, weight, grad),
            // 16-bit weights: stepped in fp32, rounded back.
            Some(store) => {
                let wide = weight.clone().cast(DType::F32);
                let new = steps.step::<D>(lr, id, wide, grad);
                store.narrow(id, weight, new)
            }
        });
        self.put_stepped(id, stepped);
    }

    /// The part of the norm of `grad` (on the host: a group's sum with this micro-batch's),
    /// brought to the device where the parts are added.
    fn host_norm_part<const D: usize>(&mut self, id: ParamId, grad: Tensor<Host, D>) {
        let part =
            crate::train::optim::timed(|| grads::norm_part(grad, self.norm_type).into_data());
        let part = Tensor::<K<B>, 1>::from_data(part, &self.device);
        self.parts.insert(id, part);
    }

    /// Optimizer offload: steps `id` on the host with its final gradient there (fp32, scaled
    /// as the loss was), prepared there as the device's step would; `log_norm_here`: the log's
    /// part of the norm is taken here (the group's sum is on the host only).
    fn step_on_host<const D: usize>(
        &mut self,
        id: ParamId,
        grad: Tensor<Host, D>,
        log_norm_here: bool,
    ) {
        if self.log_norm && log_norm_here {
            self.host_norm_part(id, grad.clone());
        }
        let grad = prepare(grad, self.unscale, self.coefficient);
        let Some(weight) = self.weights.remove(&id) else {
            return;
        };
        let weight = Tensor::<K<B>, D>::from_primitive(TensorPrimitive::Float(weight));
        let Some(Stepper::Host(steps)) = self.steps.as_mut() else {
            unreachable!("a step pass on the host holds the host's steps");
        };
        let lr = self.lr;
        let stepped = match self.store.as_mut() {
            None => steps.step::<K<B>, D>(lr, id, weight, grad),
            // 16-bit weights: no master on the host; the fp32 result rounded back here.
            Some(store) => {
                let new = steps.step_widened::<K<B>, D>(lr, id, weight.clone(), grad);
                store.narrow(id, weight, new)
            }
        };
        self.put_stepped(id, stepped);
    }

    /// `id`'s new value in the table, and its forward copy's under mixed precision.
    fn put_stepped<const D: usize>(&mut self, id: ParamId, stepped: Tensor<K<B>, D>) {
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

    /// After a norm or step pass's backward (`grads`, what it returned): a sum of the group
    /// whose parameter got no gradient in this micro-batch is used alone, in `model`'s order
    /// (its part of the norm, or its step), as the ordinary step uses a sum that no later
    /// micro-batch added to. The sums are on the host under optimizer offload; else, training
    /// alone, on the device: in fp32 they seeded the backward, and such a sum is left on its
    /// tap's node in `grads`; under mixed precision it is left in `sums`. (With peers on the
    /// device, [`Self::end_peers`] has reduced them.)
    pub(super) fn finish_sums<M: AutodiffModule<B>>(&mut self, model: &M, mut grads: B::Gradients) {
        if !matches!(self.phase, Phase::Norm | Phase::Step)
            || (self.host_sums.is_none() && self.peers.is_some())
        {
            return;
        }
        struct UseLeft<'a, B: AutodiffBackend> {
            table: &'a mut TableInner<B>,
            grads: &'a mut B::Gradients,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for UseLeft<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let table = &mut *self.table;
                if table.reached.contains(&param.id) {
                    return;
                }
                let keep = table.phase == Phase::Norm;
                if let Some(sums) = table.host_sums.as_mut() {
                    let Some(sum) = sums.sum::<D>(param.id, keep) else {
                        return;
                    };
                    table.reached.insert(param.id);
                    return match table.phase {
                        Phase::Norm => table.host_norm_part(param.id, sum),
                        _ => table.step_on_host(param.id, sum, true),
                    };
                }
                let seeded = table
                    .keys
                    .get(&param.id)
                    .and_then(|key| {
                        let grads = taps::autodiff_grads::<B>(self.grads)?;
                        taps::seeded_on::<K<B>>(grads, key)
                    })
                    .map(|sum| Tensor::<K<B>, D>::from_primitive(TensorPrimitive::Float(sum)));
                let sum = seeded.or_else(|| {
                    let sums = table.sums.as_mut()?;
                    match keep {
                        true => sums.get::<K<B>, D>(param.id),
                        false => sums.remove::<K<B>, D>(param.id),
                    }
                });
                let Some(sum) = sum else {
                    return;
                };
                table.reached.insert(param.id);
                table.use_grad(param.id, sum);
            }
        }
        model.visit(&mut UseLeft {
            table: self,
            grads: &mut grads,
        });
    }

    /// At the end of a backward with peers (`backward`: its gradients), after every tap: the
    /// gradients whose taps did not run are reduced there (see [`BackwardReduce::end`]).
    pub(super) fn end_peers(&mut self, backward: &mut Gradients) {
        let Some(peers) = &mut self.peers else {
            return;
        };
        let keep = self.phase == Phase::Norm;
        let mut earlier = earlier::<B>(self.sums.as_mut(), &self.keys, backward, keep);
        peers.end(&mut earlier);
    }

    /// After backward with peers (the gradients whose taps did not run were reduced at its end,
    /// [`Self::end_peers`]): `reached` becomes the parameters some peer had a gradient of, and
    /// the means this peer keeps but had no gradient of are used (`model`: any model with the
    /// tapped parameters' ids).
    pub(super) fn finish_peers<M: AutodiffModule<B>>(&mut self, model: &M) -> Result<()> {
        let Some(peers) = &mut self.peers else {
            return Ok(());
        };
        let (reached, deferred) = peers.finish()?;
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
    pub(super) fn norm<M: AutodiffModule<B>>(
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

/// Where [`BackwardReduce`] finds this peer's sums of the group's earlier micro-batches: the
/// fp32 sums beside half gradients (taken, or copied where `keep`), else what was seeded on
/// the taps' nodes, left in `backward`.
fn earlier<'a, B: AutodiffBackend>(
    sums: Option<&'a mut GradientsParams>,
    keys: &'a HashMap<ParamId, FloatTensor<Autodiff<K<B>>>>,
    backward: &'a mut Gradients,
    keep: bool,
) -> Earlier<'a, K<B>> {
    match sums {
        Some(sums) => Earlier::Sums { sums, keep },
        None => Earlier::Seeded {
            grads: backward,
            keys,
        },
    }
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
