//! Optimizer offload, the second half of CPU staging: the optimizer's state and the fp32 master
//! weights in host memory, each parameter stepped there by the optimizer's own rule on Flex
//! (memsave's kernels, 8-bit state too) as its gradient arrives from the device, and its new
//! value copied up (DeepSpeed's ZeRO-Offload). The device then holds the weights the forward
//! uses, the activations and the gradients in flight.
//!
//! The host state is an [`Optim`] over `Autodiff<Flex>` whose per-parameter steps
//! ([`ParamSteps`]) run with host tensors: the same rule, the same state layout, the same bytes
//! in snapshots as the device's (a snapshot written with offload resumes without, and back).
//!
//! Under accumulation the group's gradient sums are kept in host memory too ([`HostSums`],
//! ZeRO-Offload's): each micro-batch's gradient is copied down as backward makes it final and
//! added there, so the device never holds a whole set of gradients. The group's last gradient
//! is added to its sum on the host, unscaled and clipped there, as the device's step would.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Tensor, TensorPrimitive};

use super::optimizer::Optim;
use super::steps::ParamSteps;
use crate::train::snapshot::codec::CodecError;
use memsave_common::optim::OptimizerSpec;

/// The host's backend.
pub(crate) type Host = Flex;
type HostAd = Autodiff<Host>;
/// An optimizer's steps are per parameter: any module type serves as `Optim`'s.
type HostModule = burn::nn::Linear<HostAd>;

/// The optimizer's state and the fp32 master weights, in host memory.
pub(crate) struct HostState {
    optim: Optim<HostAd, HostModule>,
    /// The fp32 master of each parameter stepped so far, by id (made from the device's value at
    /// its first step).
    masters: HashMap<ParamId, FloatTensor<Host>>,
    /// The current group's gradient sums (fp32), under accumulation.
    sums: HostSums,
}

impl HostState {
    /// A fresh state for the optimizer `spec` (no state, no master yet).
    pub(crate) fn new(spec: &OptimizerSpec) -> Self {
        HostState {
            optim: Optim::new(spec),
            masters: HashMap::new(),
            sums: HostSums::default(),
        }
    }

    /// The group's sums, moved out while a backward pass adds to them or uses them up.
    pub(crate) fn take_sums(&mut self) -> HostSums {
        std::mem::take(&mut self.sums)
    }

    /// Returns what [`HostState::take_sums`] took.
    pub(crate) fn put_back_sums(&mut self, sums: HostSums) {
        self.sums = sums;
    }

    /// The state saved by [`Optim::to_bytes`] (the device's or this one's), into host memory.
    pub(crate) fn load_bytes(&mut self, bytes: &[u8]) -> Result<(), CodecError> {
        let empty = self.optim.clone();
        let optim = std::mem::replace(&mut self.optim, empty);
        self.optim = optim.load_bytes(bytes, &Default::default())?;
        Ok(())
    }

    /// The state as [`Optim::to_bytes`] writes it.
    pub(crate) fn to_bytes(&self) -> Result<Vec<u8>, CodecError> {
        self.optim.to_bytes()
    }

    /// Under mixed precision, training alone: the trainable weights of `model` (the fp32
    /// model) moved into host memory as the masters, each replaced on the device by a
    /// one-element placeholder; returns that skeleton of `model` (ids, flags, frozen weights
    /// and running statistics as they were), which [`HostState::with_masters`] fills again.
    pub(crate) fn take_masters<B: AutodiffBackend, M: AutodiffModule<B>>(&mut self, model: M) -> M {
        model.map(&mut TakeMasters {
            masters: &mut self.masters,
        })
    }

    /// `skeleton` (from [`HostState::take_masters`]) with the masters' fp32 values copied up
    /// into its placeholders: the trained fp32 model, as the device would hold it without
    /// offload.
    pub(crate) fn with_masters<B: AutodiffBackend, M: AutodiffModule<B>>(&self, skeleton: M) -> M {
        skeleton.map(&mut PutMasters {
            masters: &self.masters,
        })
    }

    /// The steps and masters, moved out while a backward pass steps parameter by parameter.
    pub(crate) fn take_steps(&mut self) -> HostSteps {
        HostSteps {
            steps: self.optim.take_steps(),
            masters: std::mem::take(&mut self.masters),
        }
    }

    /// Returns what [`HostState::take_steps`] took, as the steps left it.
    pub(crate) fn put_back(&mut self, steps: HostSteps) {
        self.optim.put_back(steps.steps);
        self.masters = steps.masters;
    }
}

/// See [`HostState::take_masters`].
struct TakeMasters<'a> {
    masters: &'a mut HashMap<ParamId, FloatTensor<Host>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for TakeMasters<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let device = tensor.device();
        let dtype = tensor.dtype();
        let master = to_host(tensor.inner());
        self.masters.insert(id, master.into_primitive().tensor());
        let placeholder = Tensor::<B, D>::zeros([1; D], &device).cast(dtype);
        Param::from_mapped_value(id, placeholder.require_grad(), mapper)
    }
}

/// See [`HostState::with_masters`].
struct PutMasters<'a> {
    masters: &'a HashMap<ParamId, FloatTensor<Host>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for PutMasters<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(master) = self.masters.get(&id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let device = tensor.device();
        drop(tensor);
        let data =
            Tensor::<Host, D>::from_primitive(TensorPrimitive::Float(master.clone())).into_data();
        let inner = B::InnerBackend::float_from_data(data, &device);
        let value = Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(inner));
        Param::from_mapped_value(id, Tensor::from_inner(value).require_grad(), mapper)
    }
}

/// Nanoseconds the host's arithmetic ran in a run (every thread of it) since the last reset:
/// a part of the run's state.
#[derive(Default)]
struct HostStepNanos(AtomicU64);

fn host_step_nanos() -> std::sync::Arc<HostStepNanos> {
    crate::run::current().part::<HostStepNanos>()
}

/// Seconds the host's arithmetic has run under optimizer offload in the current run since
/// [`reset_host_step_seconds`]: the optimizer's rule, and the group's sums, the parts of the
/// norm and the unscaling and clipping computed there (the copies to and from the device
/// excluded): what the planner prices the host's step at.
pub fn host_step_seconds() -> f64 {
    host_step_nanos().0.load(Ordering::Relaxed) as f64 * 1e-9
}

/// Starts [`host_step_seconds`] of the current run again.
pub fn reset_host_step_seconds() {
    host_step_nanos().0.store(0, Ordering::Relaxed);
}

/// `work` on the host, its time counted in [`host_step_seconds`].
pub(crate) fn timed<T>(work: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = work();
    host_step_nanos()
        .0
        .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// The host's steps during a backward pass (see [`HostState::take_steps`]).
pub(crate) struct HostSteps {
    steps: ParamSteps<HostAd>,
    masters: HashMap<ParamId, FloatTensor<Host>>,
}

impl HostSteps {
    /// Steps parameter `id` on the host with `grad` (fp32, unscaled, clipped: as the device's
    /// step takes it, see [`prepare`]): `weight` is its device value, read only where the host
    /// has no master yet. Returns the new device value, in `weight`'s dtype.
    pub(crate) fn step<K: Backend, const D: usize>(
        &mut self,
        lr: f64,
        id: ParamId,
        weight: Tensor<K, D>,
        grad: Tensor<Host, D>,
    ) -> Tensor<K, D> {
        let device = weight.device();
        let dtype = weight.dtype();
        let master = match self.masters.remove(&id) {
            Some(master) => {
                drop(weight);
                Tensor::<Host, D>::from_primitive(TensorPrimitive::Float(master))
            }
            None => to_host(weight),
        };
        let stepped = timed(|| {
            crate::memory::scope(crate::memory::phase::STEP, || {
                self.steps.step::<D>(lr, id, master, grad)
            })
        });
        let data = stepped.to_data().convert_dtype(dtype);
        self.masters.insert(id, stepped.into_primitive().tensor());
        Tensor::from_primitive(TensorPrimitive::Float(K::float_from_data(data, &device)))
    }
}

impl HostSteps {
    /// Steps parameter `id` of 16-bit weights (`weight`, on the device: their only copy, no
    /// master is kept on the host) with `grad` on the host, by the optimizer's rule in fp32.
    /// Returns the new value in fp32 on the device, for the weights' store to round back.
    pub(crate) fn step_widened<K: Backend, const D: usize>(
        &mut self,
        lr: f64,
        id: ParamId,
        weight: Tensor<K, D>,
        grad: Tensor<Host, D>,
    ) -> Tensor<K, D> {
        let device = weight.device();
        let master = to_host(weight);
        let stepped = timed(|| {
            crate::memory::scope(crate::memory::phase::STEP, || {
                self.steps.step::<D>(lr, id, master, grad)
            })
        });
        let data = stepped.into_data();
        Tensor::from_primitive(TensorPrimitive::Float(K::float_from_data(data, &device)))
    }
}

/// `tensor` copied to host memory, in fp32 (a half tensor crosses the link as it is and is cast
/// on the host: the same values, half the bytes).
pub(crate) fn to_host<K: Backend, const D: usize>(tensor: Tensor<K, D>) -> Tensor<Host, D> {
    let host: burn::tensor::Device<Host> = Default::default();
    let data = tensor.into_data().convert_dtype(DType::F32);
    Tensor::from_primitive(TensorPrimitive::Float(Host::float_from_data(data, &host)))
}

/// The ordinary step's preparation of a gradient (`grads::to_f32`, the unscaling by
/// `unscale`, the clipping by `coefficient`), on the host: the same operations on the same
/// values as the device's.
pub(crate) fn prepare<const D: usize>(
    grad: Tensor<Host, D>,
    unscale: Option<f64>,
    coefficient: Option<f64>,
) -> Tensor<Host, D> {
    timed(|| {
        let mut grad = grad;
        if let Some(unscale) = unscale {
            grad = grad.mul_scalar(unscale);
        }
        if let Some(coefficient) = coefficient {
            grad = grad.mul_scalar(coefficient);
        }
        grad
    })
}

/// A group's gradient sums in host memory (fp32), by parameter.
#[derive(Default)]
pub(crate) struct HostSums {
    sums: HashMap<ParamId, FloatTensor<Host>>,
}

impl HostSums {
    /// `grad` (this micro-batch's, on the device) copied to the host and added to its sum,
    /// the sum first as `grads::add_to_sum` adds. The same bits as the device's sums under mixed
    /// precision, and in fp32 for a parameter used once in the forward; one used several times
    /// (a head shared across levels) is summed in another order in fp32 (the device seeds its
    /// backward with the sum and adds each use to it; here the uses are added first): equal to
    /// rounding.
    pub(crate) fn add<K: Backend, const D: usize>(&mut self, id: ParamId, grad: Tensor<K, D>) {
        let grad = to_host(grad);
        let sum = match self.take(id) {
            Some(sum) => timed(|| sum + grad),
            None => grad,
        };
        self.sums.insert(id, sum.into_primitive().tensor());
    }

    /// The group's gradient of `id` so far (its sum, taken out, or kept with `keep`), with
    /// this micro-batch's `grad` (on the device) added: fp32, on the host.
    pub(crate) fn with<K: Backend, const D: usize>(
        &mut self,
        id: ParamId,
        grad: Tensor<K, D>,
        keep: bool,
    ) -> Tensor<Host, D> {
        let grad = to_host(grad);
        match self.sum::<D>(id, keep) {
            Some(sum) => timed(|| sum + grad),
            None => grad,
        }
    }

    /// The sum of `id` (taken out, or a copy with `keep`): alone where this micro-batch gave
    /// it no gradient.
    pub(crate) fn sum<const D: usize>(
        &mut self,
        id: ParamId,
        keep: bool,
    ) -> Option<Tensor<Host, D>> {
        if keep {
            let sum = self.sums.get(&id)?.clone();
            Some(Tensor::from_primitive(TensorPrimitive::Float(sum)))
        } else {
            self.take(id)
        }
    }

    /// Whether no sum is held (a group's first micro-batch, or no accumulation).
    pub(crate) fn is_empty(&self) -> bool {
        self.sums.is_empty()
    }

    fn take<const D: usize>(&mut self, id: ParamId) -> Option<Tensor<Host, D>> {
        let sum = self.sums.remove(&id)?;
        Some(Tensor::from_primitive(TensorPrimitive::Float(sum)))
    }
}
