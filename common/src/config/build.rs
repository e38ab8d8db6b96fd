//! From a configuration to the runner's Burn-free parts: the run's length, the optimizer, the
//! schedule, the planner's setting and budget. The checks that span sections live here too.
//! Each runtime makes its hooks from them (`ConfigHooks`).

use super::{under, Config, ModelKeys};
use crate::optim::{OptimizerKind, OptimizerSpec, StateDtype};
use crate::train::{LrSchedule, RunLength};
use crate::{Error, Result};

use crate::planner::advise::Setting;
use crate::planner::{Budget, WithCp};

impl<M, D> Config<M, D> {
    /// Every check that serde's types do not make themselves; errors name the key.
    pub(super) fn validate(&self) -> Result<()> {
        let hook = &self.optimizer_config;
        match (hook.kind.accumulates(), hook.cumulative_iters) {
            (false, Some(_)) => {
                return Err(Error::invalid(
                    "optimizer_config.cumulative_iters",
                    "only GradientCumulativeOptimizerHook takes it: set \
                     `optimizer_config.type = \"GradientCumulativeOptimizerHook\"`",
                ))
            }
            _ => {
                hook.groups().map_err(|e| under("optimizer_config", e))?;
            }
        }
        if let Some(fp16) = &self.fp16 {
            fp16.loss_scale.scaler().map_err(|error| match error {
                Error::InvalidValue { field, message } => {
                    Error::invalid(fp16.loss_scale.key(&field), message)
                }
                other => other,
            })?;
        }
        self.optimizer()
            .validate()
            .map_err(|e| under("optimizer", e))?;
        self.lr_schedule().validate().map_err(|error| match error {
            Error::InvalidValue { field, message } if field == "lr" => {
                Error::invalid("optimizer.lr", message)
            }
            other => under("lr_config", other),
        })
    }

    /// The budget the planner works to, for a model whose `with_cp` (at `keys.with_cp`) is
    /// `with_cp`: `Some` with `"auto"` or `"dynamic"`; an error for either without `[memory]
    /// memory_budget`, or a budget without them (which nothing would read).
    pub fn memory_budget(&self, with_cp: &WithCp, keys: &ModelKeys) -> Result<Option<Budget>> {
        match (with_cp, self.memory.memory_budget) {
            (WithCp::Auto | WithCp::Dynamic, Some(budget)) => Ok(Some(budget)),
            (WithCp::Auto | WithCp::Dynamic, None) => Err(Error::invalid(
                keys.with_cp,
                format!(
                    "{} checkpoints what a memory budget needs: set one in `[memory]` \
                     (`memory_budget = \"3GiB\"`, or `\"60%\"` of the peak without \
                     checkpointing)",
                    if *with_cp == WithCp::Auto {
                        "\"auto\""
                    } else {
                        "\"dynamic\""
                    }
                ),
            )),
            (_, Some(_)) => Err(Error::invalid(
                "memory.memory_budget",
                format!(
                    "is read by the planner only: set `{} = \"auto\"` (a plan made once) or \
                     `\"dynamic\"` (chosen as each step runs) for it to pick the segments to \
                     checkpoint",
                    keys.with_cp
                ),
            )),
            (_, None) => Ok(None),
        }
    }

    /// What the planner's advice starts from: this config's precision, optimizer and
    /// accumulation, with `micro_batch` samples per micro-step.
    pub fn planner_setting(&self, micro_batch: usize) -> Setting {
        Setting {
            fp16: self.fp16.is_some() || self.optimizer_config.kind.is_fp16(),
            micro_batch,
            cumulative: self
                .optimizer_config
                .groups()
                .map_or(1, |groups| groups.cumulative_iters()),
            adam: matches!(
                self.optimizer.kind,
                OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. }
            ),
            step_in_backward: self.optimizer_config.step_in_backward,
            int8_state: self.optimizer.state_dtype == StateDtype::Int8,
            clips: self.optimizer_config.grad_clip.is_some(),
            offload_activations: self.offload.activations,
            offload_optimizer: self.offload.optimizer,
            weight_dtype: self.optimizer.weight_dtype,
        }
    }

    /// The optimizer.
    pub fn optimizer_kind(&self) -> OptimizerKind {
        self.optimizer.kind.clone()
    }

    /// The optimizer, how it keeps its state, and how the trainable weights are kept (the
    /// stochastic rounding's draws seeded by the run's `seed`).
    pub fn optimizer(&self) -> OptimizerSpec {
        let weights = crate::weights::WeightSpec::new(
            self.optimizer.weight_dtype,
            self.optimizer.weight_rounding,
        )
        .with_seed(self.seed)
        .with_frozen(self.optimizer.frozen_dtype);
        self.optimizer
            .kind
            .clone()
            .with_state_dtype(self.optimizer.state_dtype)
            .with_weights(weights)
    }

    /// How long the run is.
    pub fn run_length(&self) -> Result<RunLength> {
        Ok(self.runner)
    }

    /// The learning-rate schedule, its base rate the optimizer's.
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            base_lr: self.optimizer.lr,
            ..self.lr_config.clone()
        }
    }
}
