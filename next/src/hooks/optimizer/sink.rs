//! The sink of the step in backward's passes: what each tap does with its parameter's
//! gradient (keep its part of the norm, add it to the group's sum, or step its parameter, on
//! the device or, under optimizer offload, on the host). The passes are [`super::in_backward`]'s.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use burn::module::{Module, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::tensor::DType;

use crate::checkpoint::nodes::lock;
use crate::grads;
use crate::train::taps::Sink;

/// What a pass's taps do with each gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Keep its part of the norm, free it.
    Norm,
    /// Step its parameter with it, free it.
    Step,
    /// Add it to the group's sum (on the host, under optimizer offload), free it: a
    /// micro-batch that does not end its group.
    Accumulate,
}

/// The settings of one pass.
pub(super) struct PassSettings {
    pub(super) phase: Phase,
    pub(super) norm_type: f64,
    /// Keep each gradient's part of the norm in a step pass too (the norm is logged).
    pub(super) log_norm: bool,
    /// The factor each gradient is multiplied by first (`1 / loss_scale`).
    pub(super) unscale: Option<f64>,
    /// The clipping factor, applied after unscaling.
    pub(super) coefficient: Option<f64>,
    /// The dtype a gradient is cast to where it starts a sum (fp32 under 16-bit weights).
    pub(super) sum_dtype: Option<DType>,
    pub(super) lr: f64,
    /// Under optimizer offload, the run's device: each gradient goes to the host as it is
    /// final, is summed, unscaled, clipped and stepped there, and the new weight comes up here.
    pub(super) offload: Option<Device>,
}

/// The sink of a pass: what its taps share.
pub(super) struct Table<M> {
    pub(super) inner: Mutex<Inner<M>>,
}

pub(super) struct Inner<M> {
    pub(super) settings: PassSettings,
    /// Each gradient's part of the norm, by parameter.
    pub(super) parts: HashMap<ParamId, Tensor<1>>,
    /// The parameters whose tap ran.
    pub(super) reached: HashSet<ParamId>,
    /// The group's earlier sums (read in a norm pass, taken in a step pass).
    pub(super) sums: GradientsParams,
    /// Each master's dtype, by parameter.
    pub(super) dtypes: HashMap<ParamId, DType>,
    /// The weights a step pass steps (the masters, on the host under optimizer offload), and
    /// the optimizer.
    pub(super) model: Option<M>,
    pub(super) optimizer: Option<ModuleOptimizer>,
    /// Under optimizer offload with the masters on the host: the device's weights, each
    /// replaced by its master's new value as it steps.
    pub(super) device_model: Option<M>,
}

impl<M: Module + 'static> Sink for Table<M> {
    fn on_grad<const D: usize>(&self, id: ParamId, grad: Tensor<D>) {
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        inner.reached.insert(id);
        let settings = &inner.settings;
        let grad = match settings.offload {
            Some(_) => crate::offload::down(grad),
            None => grad,
        };
        // The host's arithmetic from here, under optimizer offload (the copies excluded).
        let timer = crate::offload::HostTimer::start(settings.offload.is_some());
        // As `grads::accumulate` adds it to the group's sum, in the sum's dtype or its master's.
        let earlier = match settings.phase {
            Phase::Norm => inner.sums.get::<D>(id),
            Phase::Step | Phase::Accumulate => inner.sums.remove::<D>(id),
        };
        let grad = match earlier {
            Some(sum) => {
                let dtype = sum.dtype();
                sum + grad.cast(dtype)
            }
            None => {
                let dtype = settings
                    .sum_dtype
                    .or_else(|| inner.dtypes.get(&id).copied())
                    .unwrap_or(grad.dtype());
                grad.cast(dtype)
            }
        };
        if settings.phase == Phase::Accumulate {
            inner.sums.register::<D>(id, grad);
            timer.stop();
            return;
        }
        let grad = match settings.unscale {
            Some(factor) => grad.mul_scalar(factor),
            None => grad,
        };
        if settings.phase == Phase::Norm || settings.log_norm {
            let part = grads::norm_part(grad.clone(), settings.norm_type);
            inner.parts.insert(id, part);
        }
        if settings.phase == Phase::Norm {
            timer.stop();
            return;
        }
        let grad = match settings.coefficient {
            Some(factor) => grad.mul_scalar(factor),
            None => grad,
        };
        let mut one = GradientsParams::new();
        one.register::<D>(id, grad);
        let (Some(model), Some(optimizer)) = (inner.model.take(), inner.optimizer.as_mut()) else {
            timer.stop();
            return;
        };
        let Some(device) = &settings.offload else {
            inner.model = Some(optimizer.step(settings.lr, model, one));
            return;
        };
        timer.stop();
        // 16-bit weights (the stepped model is the device's): the weight itself goes down.
        let model = match inner.device_model {
            Some(_) => model,
            None => crate::offload::down_param(model, id),
        };
        let timer = crate::offload::HostTimer::start(true);
        let stepped = optimizer.step(settings.lr, model, one);
        timer.stop();
        crate::offload::count_steps(1);
        // The new weight up to the device, the old one dropped there.
        let mut value = crate::offload::values_of(&stepped, Some(&[id]));
        match inner.device_model.take() {
            Some(on_device) => {
                inner.device_model =
                    Some(crate::offload::put_up(on_device, &mut value, device, true));
                inner.model = Some(stepped);
            }
            // 16-bit weights: no master on the host; the stepped weight goes back in place.
            None => inner.model = Some(crate::offload::put_up(stepped, &mut value, device, true)),
        }
    }
}
