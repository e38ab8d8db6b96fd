//! The optimizer hook's step on the host (optimizer offload, `[offload] optimizer = true`;
//! DeepSpeed's ZeRO-Offload): the optimizer's state and the fp32 master weights live in host
//! memory ([`crate::offload`]); in backward, each gradient, as soon as it is final, goes to the
//! host and is freed on the device, its parameter steps there with the user's optimizer, and the
//! new value goes up. It taps as the step in backward does (one pass, or two under clipping or
//! mixed precision: the same norm pass and the same overflow skip) and differs only in where
//! each parameter steps: the ordinary step's arithmetic on the host's backend (on the CPU the
//! same weights bit for bit).
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
//! run the model is fp32 again, from the masters (and where the run ends with an error too).
//! 16-bit weights are their only copy, on the device: each goes down for its step and back up,
//! and the host keeps their optimizer's state and no master.
//!
//! The move to the host happens before the run's first forward, once every hook's `before_run`
//! has set the model up (the `with_cp` switches of `"dynamic"` among them). A resumed
//! optimizer's state waits on Burn's default device until its parameter first steps (Burn
//! 0.22's `ModuleOptimizer::load_record` puts it there, and has no call that moves it): on a
//! device with memory of its own that is the device, until the first step.

use std::any::Any;

use super::OptimizerHook;
use crate::train::{TrainModel, TrainState};

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
    /// ZeRO-Offload): the step runs in backward (as [`OptimizerHook::with_step_in_backward`]
    /// says, in one pass or two), and the device holds the weights the forward reads, the
    /// activations and the gradients in flight. Each step is the ordinary step's arithmetic on
    /// the host's backend (Flex): on the CPU the same weights bit for bit. On a device whose
    /// tensors are host memory (the CPU) there is nothing to offload to: the run says so once
    /// and steps as without.
    pub fn with_optimizer_offload(mut self, on: bool) -> Self {
        self.offload = on.then(OptimizerOffload::default);
        self
    }

    /// Whether the optimizer's state and the masters are to be kept on the host.
    pub fn optimizer_offload(&self) -> bool {
        self.offload.is_some()
    }

    /// Before the run: on a device whose tensors are host memory, offload goes with a warning;
    /// otherwise the step runs in backward.
    pub(super) fn offload_before_run<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        if self.offload.is_none() {
            return;
        }
        if let Err(why) = crate::offload::can_offload(&state.device) {
            state.warn(format!(
                "`offload.optimizer`: {why}; the optimizer steps on the device, as without it"
            ));
            self.offload = None;
            return;
        }
        self.in_backward.get_or_insert_with(Default::default);
    }

    /// Before the run's first forward (every hook's `before_run` done: the `with_cp` switches
    /// they set are the model's): the masters to the host; under mixed precision the device's
    /// fp32 weights go and the half copy becomes the model.
    pub(super) fn offload_start<M: TrainModel>(&mut self, state: &mut TrainState<M>) {
        let Some(offload) = self
            .offload
            .as_mut()
            .filter(|offload| offload.held.is_none())
        else {
            return;
        };
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
    }

    /// Whether the run's masters are on the host now.
    pub(super) fn offloaded(&self) -> bool {
        self.offload
            .as_ref()
            .is_some_and(|offload| offload.held.is_some())
    }

    /// The masters on the host, where the run keeps them there.
    pub(super) fn host_masters<M: TrainModel>(offload: &Option<OptimizerOffload>) -> Option<&M> {
        held_in::<M>(offload)?.masters.as_ref()
    }

    fn held<M: TrainModel>(&self) -> Option<&Held<M>> {
        held_in(&self.offload)
    }

    /// The step pass's access to the masters on the host (their slot: the pass takes them).
    pub(super) fn host_masters_mut<M: TrainModel>(
        offload: &mut Option<OptimizerOffload>,
    ) -> Option<&mut Option<M>> {
        let held = offload.as_mut()?.held.as_mut()?;
        let held = held
            .downcast_mut::<Held<M>>()
            .expect("held for the model the hook trains");
        Some(&mut held.masters)
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
            false,
        ))
    }

    /// After the run (or where it ends with an error): the model fp32 on the device again,
    /// from the masters, the half copy beside it as without offload; the host's state let go.
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
            let fp32 = crate::offload::put_up(skeleton, &mut values, &state.device, false);
            state.forward_model = Some(std::mem::replace(&mut state.model, fp32));
        }
    }
}

/// The run's [`Held`], where offload holds one.
fn held_in<M: TrainModel>(offload: &Option<OptimizerOffload>) -> Option<&Held<M>> {
    let held = offload.as_ref()?.held.as_ref()?;
    Some(
        held.downcast_ref::<Held<M>>()
            .expect("held for the model the hook trains"),
    )
}
