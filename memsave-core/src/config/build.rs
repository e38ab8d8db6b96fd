//! From a configuration to the runner's parts: the optimizer hook, the other hooks, the run's
//! length, the optimizer. The checks that span sections live here too.

use burn::tensor::backend::AutodiffBackend;

use super::{under, Config, ModelKeys};
use crate::hooks::{LoggerHook, LrSchedule, LrUpdaterHook, OptimizerHook, SnapshotHook};
use crate::train::{Hook, OptimizerKind, OptimizerSpec, RunLength, TrainModel};
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
            int8_state: self.optimizer.state_dtype == crate::train::StateDtype::Int8,
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
        let weights = crate::train::WeightSpec::new(
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

    /// The optimizer hook: the configured corner, made mixed-precision by an `[fp16]` section.
    pub fn optimizer_hook<B: AutodiffBackend, Mo: TrainModel<B>>(
        &self,
    ) -> Result<Box<dyn Hook<B, Mo>>> {
        Ok(Box::new(self.optimizer_hook_of()?))
    }

    /// [`Config::optimizer_hook`], as its concrete type.
    pub fn optimizer_hook_of(&self) -> Result<OptimizerHook> {
        let section = &self.optimizer_config;
        let mut hook = OptimizerHook::new()
            .with_grad_clip(section.grad_clip)
            .with_detect_anomalous_params(section.detect_anomalous_params)
            .with_step_in_backward(section.step_in_backward)
            .with_optimizer_offload(self.offload.optimizer);
        let groups = section.groups().map_err(|e| under("optimizer_config", e))?;
        hook = hook.with_groups(groups);
        let fp16 = match (&self.fp16, section.kind.is_fp16()) {
            (Some(fp16), _) => Some(fp16.clone()),
            (None, true) => Some(Default::default()),
            (None, false) => None,
        };
        if let Some(fp16) = fp16 {
            let scaler = fp16.loss_scale.scaler()?;
            hook = hook.with_mixed_precision(scaler, fp16.precision);
        }
        Ok(hook)
    }

    /// The other hooks: learning rate, snapshots, log, the config keys of the strategies for the
    /// advice of a step that does not fit, and activation offload where `[offload]` asks.
    pub fn hooks<B: AutodiffBackend, Mo: TrainModel<B>>(&self) -> Vec<Box<dyn Hook<B, Mo>>> {
        // The host budget as the run starts (unknown where the machine's memory cannot be read
        // and no budget is given: then unbounded).
        let host_budget = self.memory.host_budget().ok().flatten();
        let accumulates = self
            .optimizer_config
            .groups()
            .is_ok_and(|groups| groups.cumulative_iters() > 1);
        let offload = self.offload.activations().map(|setting| {
            Box::new(
                crate::hooks::OffloadHook::new(setting)
                    .with_host_budget(host_budget)
                    .with_optimizer_offload(self.offload.optimizer, accumulates)
                    .with_zero_stage(self.optimizer_config.zero().unwrap_or_default()),
            ) as Box<dyn Hook<B, Mo>>
        });
        let mut hooks: Vec<Box<dyn Hook<B, Mo>>> = vec![
            Box::new(LrUpdaterHook {
                schedule: self.lr_schedule(),
            }),
            Box::new(SnapshotHook::from_config(
                &self.checkpoint_config,
                self.runner.by_epoch(),
            )),
            Box::new(LoggerHook::new(self.log_config.interval)),
            Box::new(StrategyKeys),
            Box::new(RunChoices {
                unused_with_cp: self.unused_with_cp,
            }),
        ];
        hooks.extend(offload);
        hooks
    }
}

/// Puts the config's choices for the run in its context before the first step.
struct RunChoices {
    unused_with_cp: crate::checkpoint::UnusedWithCp,
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for RunChoices {
    fn name(&self) -> &'static str {
        "run_choices"
    }

    fn before_run(&mut self, _state: &mut crate::train::TrainState<B, M>) -> Result<()> {
        crate::checkpoint::set_unused_with_cp(self.unused_with_cp);
        Ok(())
    }
}

/// Names the config keys of the strategies when a step does not fit.
struct StrategyKeys;

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for StrategyKeys {
    fn name(&self) -> &'static str {
        "strategy_keys"
    }

    fn out_of_memory_advice(&self, _state: &crate::train::TrainState<B, M>) -> Option<String> {
        Some(
            "in the config: mixed precision is `[fp16]`, accumulation \
             `optimizer_config.cumulative_iters`, checkpointing `with_cp = true`; `memsave plan \
             CONFIG --budget SIZE` measures which combination fits SIZE at the least cost, and \
             `with_cp = \"auto\"` with `[memory] memory_budget = SIZE` checkpoints only the \
             blocks that SIZE needs"
                .to_string(),
        )
    }
}
