//! The optimizer hook's step on the host (optimizer offload, `[offload] optimizer = true`;
//! DeepSpeed's ZeRO-Offload): the optimizer's state and the fp32 master weights live in host
//! memory ([`crate::offload`]); in backward, each gradient, as soon as it is final, goes to the
//! host and is freed on the device, its parameter steps there with the user's optimizer, and the
//! new value goes up. It taps as the step in backward does (one pass, or two under clipping or
//! mixed precision: the same norm pass and the same overflow skip) and differs only in where
//! each parameter steps, so it trains the ordinary step's weights bit for bit.
//!
//! Under accumulation the group's sums are on the host too: each micro-batch that does not end
//! its group is tapped, and each gradient, as soon as it is final, goes to the host and is added
//! to its sum there, so the device never holds a whole set of gradients.
//!
//! Under mixed precision the device keeps no fp32 copy of the trained weights: before the run
//! they move to the host as the masters and `TrainState::model` becomes the half copy the
//! forward runs on, stepped in place (each new value goes up in half); snapshots save the
//! masters (with the device's running statistics and frozen weights), evaluation during the run
//! reads the half model (as MMCV's `Fp16OptimizerHook` evaluates its half model), and after the
//! run the model is fp32 again, from the masters. 16-bit weights are their only copy, on the
//! device: the host keeps their optimizer's state and no master.

use std::any::Any;

use super::OptimizerHook;
use crate::train::{TrainModel, TrainState};
use crate::{Error, Result};

/// What optimizer offload holds across a run.
#[derive(Default)]
pub(super) struct OptimizerOffload {
    /// A [`Held`] of the model the hook trains, from the start of the run to its end.
    held: Option<Box<dyn Any>>,
}

impl std::fmt::Debug for OptimizerOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OptimizerOffload")
            .field("running", &self.held.is_some())
            .finish()
    }
}

/// The host's part of a run.
struct Held<M> {
    /// The fp32 masters, on the host (none under 16-bit weights).
    masters: Option<M>,
    /// Under mixed precision: the fp32 model on the device with its trainable weights taken
    /// out (their ids, the frozen weights, the running statistics kept), which the masters
    /// fill again for a snapshot and at the end of the run.
    skeleton: Option<M>,
}

impl OptimizerHook {
    /// The same hook keeping the optimizer's state and the fp32 master weights in host memory,
    /// each parameter stepped there as soon as its gradient is final (DeepSpeed's
    /// ZeRO-Offload): the step runs in backward ([`OptimizerHook::with_step_in_backward`]),
    /// and the device holds the weights the forward reads, the activations and the gradients
    /// in flight. The same weights as the ordinary step, bit for bit. On a device whose tensors
    /// are host memory (the CPU) the run ends with an error saying it saves nothing.
    pub fn with_optimizer_offload(mut self, on: bool) -> Self {
        self.offload = on.then(OptimizerOffload::default);
        if on && self.in_backward.is_none() {
            self = self.with_step_in_backward(true);
        }
        self
    }

    /// Whether the optimizer's state and the masters are kept on the host.
    pub fn optimizer_offload(&self) -> bool {
        self.offload.is_some()
    }

    /// Before the run (after the model is cast and its half copy made): the masters to the
    /// host; under mixed precision the device's fp32 weights go and the half copy becomes the
    /// model.
    pub(super) fn offload_before_run<M: TrainModel>(
        &mut self,
        state: &mut TrainState<M>,
    ) -> Result<()> {
        let Some(offload) = self.offload.as_mut() else {
            return Ok(());
        };
        crate::offload::can_offload(&state.device)
            .map_err(|why| Error::invalid("offload.optimizer", why))?;
        let held = if self.weights16.is_some() {
            Held::<M> {
                masters: None,
                skeleton: None,
            }
        } else {
            let masters = crate::offload::to_host(state.model.clone());
            let skeleton = state.forward_model.take().map(|half| {
                crate::offload::without_trainable(std::mem::replace(&mut state.model, half))
            });
            Held {
                masters: Some(masters),
                skeleton,
            }
        };
        offload.held = Some(Box::new(held));
        Ok(())
    }

    /// Whether the run's masters are on the host now.
    pub(super) fn offloaded(&self) -> bool {
        self.offload
            .as_ref()
            .is_some_and(|offload| offload.held.is_some())
    }

    /// The masters on the host, where the run keeps them there.
    pub(super) fn host_masters<M: TrainModel>(offload: &Option<OptimizerOffload>) -> Option<&M> {
        let held = offload.as_ref()?.held.as_ref()?;
        held.downcast_ref::<Held<M>>()
            .expect("held for the model the hook trains")
            .masters
            .as_ref()
    }

    fn held<M: TrainModel>(&self) -> Option<&Held<M>> {
        let held = self.offload.as_ref()?.held.as_ref()?;
        Some(
            held.downcast_ref::<Held<M>>()
                .expect("held for the model the hook trains"),
        )
    }

    /// The step pass's access to the masters on the host.
    pub(super) fn host_masters_mut<M: TrainModel>(
        offload: &mut Option<OptimizerOffload>,
    ) -> Option<&mut M> {
        let held = offload.as_mut()?.held.as_mut()?;
        held.downcast_mut::<Held<M>>()
            .expect("held for the model the hook trains")
            .masters
            .as_mut()
    }

    /// The fp32 model the device would hold without offload under mixed precision: the
    /// skeleton filled with the masters (on the host). `None` where the model is that already.
    pub(super) fn offloaded_fp32_model<M: TrainModel>(&self) -> Option<M> {
        let held = self.held::<M>()?;
        let (skeleton, masters) = (held.skeleton.as_ref()?, held.masters.as_ref()?);
        let ids = crate::offload::trainable_ids(skeleton);
        let mut values = crate::offload::values_of(masters, Some(&ids));
        Some(crate::offload::put_up(
            skeleton.clone(),
            &mut values,
            &crate::offload::host(),
        ))
    }

    /// After the run: the model fp32 on the device again, from the masters, the half copy
    /// beside it as without offload; the host's state let go.
    pub(super) fn offload_after_run<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        let Some(held) = self
            .offload
            .as_mut()
            .and_then(|offload| offload.held.take())
        else {
            return;
        };
        let held = held
            .downcast::<Held<M>>()
            .expect("held for the model the hook trains");
        if let (Some(skeleton), Some(masters)) = (held.skeleton, held.masters) {
            let ids = crate::offload::trainable_ids(&skeleton);
            let mut values = crate::offload::values_of(&masters, Some(&ids));
            drop(masters);
            let fp32 = crate::offload::put_up(skeleton, &mut values, &state.device);
            state.forward_model = Some(std::mem::replace(&mut state.model, fp32));
        }
    }
}
