//! CPU staging ("offload", the one name memsave gives it on Burn 0.22: the config's
//! `[offload]`, `OptimizerHook::with_optimizer_offload`, this module): tensors kept in host
//! memory instead of the device's. This slice of the port has its optimizer half: the optimizer's
//! state and the fp32 master weights on the host, each parameter stepped there as its gradient
//! is final (DeepSpeed's ZeRO-Offload; the optimizer hook's `with_optimizer_offload`). Activation
//! offload comes with CubeCL's devices (on the CPU it has nothing to save).
//!
//! The host is Burn's Flex backend: the optimizer the user gave (any `ModuleOptimizer`) steps
//! host tensors there, and its state follows them (Burn 0.22's module optimizer keeps each
//! parameter's state on its gradient's device), so nothing of the optimizer's is rewritten.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use burn::backend::DispatchDevice;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::DispatchTensor;

/// The host's device: Flex, without autodiff.
pub fn host() -> Device {
    Device::flex()
}

/// Whether `device` keeps its tensors in host memory (Flex): offloading to the host saves
/// nothing there.
pub fn is_host_resident(device: &Device) -> bool {
    let device = device.clone().without_autodiff();
    matches!(device.as_dispatch(), DispatchDevice::Flex(_))
}

/// The run's switch of [`stage_on_host_resident_devices`].
#[derive(Default)]
struct HostAsDevice(AtomicBool);

/// Lets CPU staging run, in the current run, on a device whose tensors are host memory (Flex)
/// as on a device with memory of its own: the same copies and steps on the host, nothing
/// saved. For tests of what staging does where no device is; returns the previous setting.
#[doc(hidden)]
pub fn stage_on_host_resident_devices(on: bool) -> bool {
    crate::run::current()
        .part::<HostAsDevice>()
        .0
        .swap(on, Ordering::Relaxed)
}

/// Whether CPU staging can save anything on `device`: `Err` says why not.
pub fn can_offload(device: &Device) -> Result<(), String> {
    let staged_anyway = crate::run::current()
        .part::<HostAsDevice>()
        .0
        .load(Ordering::Relaxed);
    if is_host_resident(device) && !staged_anyway {
        return Err(format!(
            "the device {device:?} keeps its tensors in host memory: host and device are one \
             memory, and offloading to the host saves nothing; train without it on the CPU"
        ));
    }
    Ok(())
}

/// What optimizer offload did in a run since the last [`reset_optimizer_offload_stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OptimizerOffloadStats {
    /// Parameters stepped on the host (one per parameter and step).
    pub host_steps: u64,
    /// Bytes of gradients copied to the host.
    pub bytes_down: u64,
    /// Bytes of stepped weights copied up to the device.
    pub bytes_up: u64,
    /// Seconds the host's arithmetic ran (the sums, unscaling, clipping and the optimizer's
    /// rule; the copies excluded): what the planner prices the host's step at.
    pub host_seconds: f64,
}

/// The run's counts behind [`OptimizerOffloadStats`].
#[derive(Default)]
struct Counts {
    host_steps: AtomicU64,
    bytes_down: AtomicU64,
    bytes_up: AtomicU64,
    host_nanos: AtomicU64,
}

fn counts() -> std::sync::Arc<Counts> {
    crate::run::current().part::<Counts>()
}

/// What optimizer offload did in the current run since [`reset_optimizer_offload_stats`].
pub fn optimizer_offload_stats() -> OptimizerOffloadStats {
    let counts = counts();
    OptimizerOffloadStats {
        host_steps: counts.host_steps.load(Ordering::Relaxed),
        bytes_down: counts.bytes_down.load(Ordering::Relaxed),
        bytes_up: counts.bytes_up.load(Ordering::Relaxed),
        host_seconds: counts.host_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
    }
}

/// Starts [`optimizer_offload_stats`] of the current run again.
pub fn reset_optimizer_offload_stats() {
    let counts = counts();
    for count in [
        &counts.host_steps,
        &counts.bytes_down,
        &counts.bytes_up,
        &counts.host_nanos,
    ] {
        count.store(0, Ordering::Relaxed);
    }
}

/// `tensor`'s bytes.
fn bytes_of<const D: usize>(tensor: &Tensor<D>) -> u64 {
    (tensor.shape().num_elements() * tensor.dtype().size()) as u64
}

/// `grad` copied to the host (without autodiff), counted.
pub(crate) fn down<const D: usize>(grad: Tensor<D>) -> Tensor<D> {
    counts()
        .bytes_down
        .fetch_add(bytes_of(&grad), Ordering::Relaxed);
    grad.inner().to_device(&host())
}

/// A stretch of the host's arithmetic, timed into [`OptimizerOffloadStats::host_seconds`]
/// where it runs (optimizer offload on).
pub(crate) struct HostTimer(Option<Instant>);

impl HostTimer {
    /// Starts timing where `on`.
    pub(crate) fn start(on: bool) -> Self {
        HostTimer(on.then(Instant::now))
    }

    /// Adds the time since the start.
    pub(crate) fn stop(self) {
        if let Some(started) = self.0 {
            counts()
                .host_nanos
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}

/// Counts `steps` parameters stepped on the host.
pub(crate) fn count_steps(steps: u64) {
    counts().host_steps.fetch_add(steps, Ordering::Relaxed);
}

/// `module` with parameter `id` copied to the host (its autodiff context kept: Burn's module
/// optimizer steps it there and gives it back in that context), counted: a 16-bit weight going
/// down for its step.
pub(crate) fn down_param<M: Module>(module: M, id: ParamId) -> M {
    struct Down(ParamId);
    impl ModuleMapper for Down {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            if id != self.0 {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            counts()
                .bytes_down
                .fetch_add(bytes_of(&tensor), Ordering::Relaxed);
            Param::from_mapped_value(id, tensor.to_device(&host()), mapper)
        }
    }
    module.map(&mut Down(id))
}

/// `module`'s trainable float parameters copied to the host, ids kept (on autodiff, where
/// Burn's module optimizer steps a parameter; no graph is ever recorded there); the rest as it
/// is (its constants, and its running statistics, which a clone shares with the original: a
/// copy of them would be the original's too).
pub(crate) fn to_host<M: Module>(module: M) -> M {
    struct ToHost(Device);
    impl ModuleMapper for ToHost {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            if !tensor.is_require_grad() {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let host = tensor.inner().to_device(&self.0).autodiff().require_grad();
            Param::from_mapped_value(id, host, mapper)
        }
    }
    module.map(&mut ToHost(host()))
}

/// The values of `module`'s float parameters `ids` (all of them with `None`), by id.
pub(crate) fn values_of<M: Module>(
    module: &M,
    ids: Option<&[ParamId]>,
) -> HashMap<ParamId, DispatchTensor> {
    struct Values<'a> {
        ids: Option<&'a [ParamId]>,
        found: HashMap<ParamId, DispatchTensor>,
    }
    impl ModuleVisitor for Values<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.ids.is_none_or(|ids| ids.contains(&param.id)) {
                self.found.insert(param.id, param.val().into_dispatch());
            }
        }
    }
    let mut values = Values {
        ids,
        found: HashMap::new(),
    };
    module.visit(&mut values);
    values.found
}

/// `module` with each parameter in `values` (host tensors, by id) copied to `device` in place
/// of its value: in the old value's dtype, with its autodiff context (strategy,
/// `require_grad`) kept. The old value is dropped as it is replaced. `uploads`: the copies are
/// stepped weights going up, counted in [`OptimizerOffloadStats::bytes_up`].
pub(crate) fn put_up<M: Module>(
    module: M,
    values: &mut HashMap<ParamId, DispatchTensor>,
    device: &Device,
    uploads: bool,
) -> M {
    struct PutUp<'a> {
        values: &'a mut HashMap<ParamId, DispatchTensor>,
        device: Device,
        up: u64,
    }
    impl ModuleMapper for PutUp<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, old, mapper) = param.consume();
            let Some(value) = self.values.remove(&id) else {
                return Param::from_mapped_value(id, old, mapper);
            };
            let (dtype, strategy) = (old.dtype(), old.gradient_checkpointing_strategy());
            let require_grad = old.is_require_grad();
            drop(old);
            let value = Tensor::<D>::from_dispatch(value).inner().cast(dtype);
            self.up += bytes_of(&value);
            let value = value.to_device(&self.device);
            let value = match strategy {
                Some(strategy) => value
                    .autodiff()
                    .with_gradient_checkpointing_strategy(strategy),
                None => value,
            };
            let value = if require_grad {
                value.require_grad()
            } else {
                value
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let mut put = PutUp {
        values,
        device: device.clone().without_autodiff(),
        up: 0,
    };
    let module = module.map(&mut put);
    if uploads {
        counts().bytes_up.fetch_add(put.up, Ordering::Relaxed);
    }
    module
}

/// `module`'s trainable float parameters replaced by one-element placeholders of their dtype
/// (their ids, contexts and every other part kept): what the device keeps of a model whose
/// trainable weights live on the host.
pub(crate) fn without_trainable<M: Module>(module: M) -> M {
    struct Hollow;
    impl ModuleMapper for Hollow {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            if !tensor.is_require_grad() {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let placeholder = Tensor::<D>::zeros([1; D], &tensor.device())
                .cast(tensor.dtype())
                .require_grad();
            Param::from_mapped_value(id, placeholder, mapper)
        }
    }
    module.map(&mut Hollow)
}

/// The ids of `module`'s trainable float parameters, in visiting order.
pub(crate) fn trainable_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.val().is_require_grad() {
                self.0.push(param.id);
            }
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}
