//! What a step is made of ([`Setting`]), and a profile measured in one ([`Measured`]).

use serde::{Deserialize, Serialize};

use crate::planner::Profile;

/// What a step is made of, for the advice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setting {
    /// Mixed precision.
    pub fp16: bool,
    /// Samples per micro-step.
    pub micro_batch: usize,
    /// Micro-steps per optimizer step.
    pub cumulative: usize,
    /// Adam or AdamW: two moments per weight (else SGD, with at most one).
    pub adam: bool,
    /// The optimizer steps each parameter in backward (`step_in_backward`).
    #[serde(default)]
    pub step_in_backward: bool,
    /// The optimizer's state is kept in 8 bits (`state_dtype = "int8"`).
    #[serde(default)]
    pub int8_state: bool,
    /// The config clips the gradients by their global norm (a step in backward then takes two
    /// passes).
    #[serde(default)]
    pub clips: bool,
    /// Activation offload (`offload.activations`): the inputs checkpointed segments keep wait
    /// in host memory.
    #[serde(default)]
    pub offload_activations: bool,
    /// Optimizer offload (`offload.optimizer`): the optimizer's state and the fp32 masters in
    /// host memory, each parameter stepped there in backward.
    #[serde(default)]
    pub offload_optimizer: bool,
    /// The trainable weights' type (`optimizer.weight_dtype`): their bytes in every window
    /// (2 a weight in 16 bits, where the state and the sums stay 4).
    #[serde(default)]
    pub weight_dtype: crate::weights::WeightDtype,
}

impl Setting {
    /// Samples per optimizer step.
    pub fn batch(&self) -> usize {
        self.micro_batch * self.cumulative
    }

    /// Forwards and backwards per micro-batch that steps: 2 for a step in backward (or on the
    /// host, which taps as it does) under clipping or mixed precision, else 1.
    pub fn passes(&self) -> usize {
        if (self.step_in_backward || self.offload_optimizer) && (self.clips || self.fp16) {
            2
        } else {
            1
        }
    }

    /// Copies of the trainable weights the optimizer keeps: Adam's two moments, SGD's momentum.
    pub fn state_copies(&self) -> u64 {
        if self.adam {
            2
        } else {
            1
        }
    }
}

/// A measured profile and the setting it was measured in.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The setting.
    pub setting: Setting,
    /// Its profile.
    pub profile: Profile,
}
