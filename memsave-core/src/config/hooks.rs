//! From a configuration to the runner's hooks on Burn 0.21: the optimizer hook, and the
//! learning rate, snapshots, the log, the strategies' keys and activation offload.

use burn::tensor::backend::AutodiffBackend;

use super::Config;
use crate::hooks::{LoggerHook, LrUpdaterHook, OptimizerHook, SnapshotHook};
use crate::train::{Hook, TrainModel};
use crate::Result;

/// A config's hooks for memsave's runner (the config is memsave-common's; this trait is the
/// part that names the runner's types).
pub trait ConfigHooks {
    /// The optimizer hook: the configured corner, made mixed-precision by an `[fp16]` section.
    fn optimizer_hook<B: AutodiffBackend, Mo: TrainModel<B>>(&self)
        -> Result<Box<dyn Hook<B, Mo>>>;

    /// [`ConfigHooks::optimizer_hook`], as its concrete type.
    fn optimizer_hook_of(&self) -> Result<OptimizerHook>;

    /// The other hooks: learning rate, snapshots, log, the config keys of the strategies for the
    /// advice of a step that does not fit, and activation offload where `[offload]` asks.
    fn hooks<B: AutodiffBackend, Mo: TrainModel<B>>(&self) -> Vec<Box<dyn Hook<B, Mo>>>;
}

impl<M, D> ConfigHooks for Config<M, D> {
    fn optimizer_hook<B: AutodiffBackend, Mo: TrainModel<B>>(
        &self,
    ) -> Result<Box<dyn Hook<B, Mo>>> {
        Ok(Box::new(self.optimizer_hook_of()?))
    }

    fn optimizer_hook_of(&self) -> Result<OptimizerHook> {
        let section = &self.optimizer_config;
        let mut hook = OptimizerHook::new()
            .with_grad_clip(section.grad_clip)
            .with_detect_anomalous_params(section.detect_anomalous_params)
            .with_step_in_backward(section.step_in_backward)
            .with_optimizer_offload(self.offload.optimizer);
        let groups = section.groups().map_err(|e| e.within("optimizer_config"))?;
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

    fn hooks<B: AutodiffBackend, Mo: TrainModel<B>>(&self) -> Vec<Box<dyn Hook<B, Mo>>> {
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
