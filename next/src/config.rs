//! The TOML configuration (memsave-common's [`Config`], MMCV's section names, the same file
//! memsave on Burn 0.21 reads) and what it makes on Burn 0.22 ([`ConfigHooks`]): the optimizer,
//! the optimizer hook and the other hooks of [`crate::train::Runner`].
//!
//! ```rust,ignore
//! let config: Config<MyModelSection, MyDataSection> = Config::load(path, &overrides)?;
//! let mut runner = Runner::new(model, config.build_optimizer()?, config.optimizer_hook()?,
//!                              data, config.run_length()?, work_dir, device)?;
//! for hook in config.hooks()? {
//!     runner.register_hook(hook);
//! }
//! runner.run()?;
//! ```

use crate::hooks::{LoggerHook, LrUpdaterHook, OptimizerHook, SnapshotHook};
use crate::train::{optimizer, Hook, TrainModel, TrainState};
use crate::{Error, Result};
use burn::optim::ModuleOptimizer;

pub use memsave_common::config::*;

/// A config's optimizer and hooks for memsave's runner on Burn 0.22. The settings Burn 0.22
/// does not have yet (activation offload, ZeRO)
/// are errors naming the key, never dropped in silence.
pub trait ConfigHooks {
    /// The optimizer (`[optimizer]`: its kind, its state's type, the weights' type).
    fn build_optimizer(&self) -> Result<ModuleOptimizer>;

    /// The optimizer hook: the configured corner, made mixed-precision by an `[fp16]` section,
    /// for 16-bit weights where `optimizer.weight_dtype` keeps them.
    fn optimizer_hook_of(&self) -> Result<OptimizerHook>;

    /// [`ConfigHooks::optimizer_hook`], boxed for [`crate::train::Runner::new`].
    fn optimizer_hook<Mo: TrainModel>(&self) -> Result<Box<dyn Hook<Mo>>> {
        Ok(Box::new(self.optimizer_hook_of()?))
    }

    /// The other hooks: the learning-rate schedule, snapshots, the log, and the run's choice
    /// for a `with_cp` switch without a `#[with_cp]` method.
    fn hooks<Mo: TrainModel>(&self) -> Result<Vec<Box<dyn Hook<Mo>>>>;
}

/// An error for a setting Burn 0.22 does not have yet.
fn not_yet(key: &str, what: &str, instead: &str) -> Error {
    Error::invalid(
        key,
        format!(
            "{what} is not on Burn 0.22 yet (a later slice of memsave's port brings it): \
             {instead}, or train with memsave on Burn 0.21"
        ),
    )
}

impl<M, D> ConfigHooks for Config<M, D> {
    fn build_optimizer(&self) -> Result<ModuleOptimizer> {
        optimizer(&self.optimizer())
    }

    fn optimizer_hook_of(&self) -> Result<OptimizerHook> {
        let section = &self.optimizer_config;
        if section.zero_stage != 0 {
            return Err(not_yet("optimizer_config.zero_stage", "ZeRO", "set it 0"));
        }
        let groups = section
            .groups()
            .map_err(|error| error.within("optimizer_config"))?;
        let mut hook = OptimizerHook::new()
            .with_grad_clip(section.grad_clip)
            .with_detect_anomalous_params(section.detect_anomalous_params)
            .with_groups(groups)
            .with_step_in_backward(section.step_in_backward)
            .with_optimizer_offload(self.offload.optimizer)
            .with_frozen_dtype(self.optimizer.frozen_dtype);
        let fp16 = match (&self.fp16, section.kind.is_fp16()) {
            (Some(fp16), _) => Some(fp16.clone()),
            (None, true) => Some(Default::default()),
            (None, false) => None,
        };
        if let Some(fp16) = fp16 {
            hook = hook.with_mixed_precision(fp16.loss_scale.scaler()?, fp16.precision);
        }
        if let Some(precision) = self.optimizer.weight_dtype.precision() {
            hook = hook.with_weights16(precision);
        }
        Ok(hook)
    }

    fn hooks<Mo: TrainModel>(&self) -> Result<Vec<Box<dyn Hook<Mo>>>> {
        if self.offload.activations {
            return Err(not_yet(
                "offload.activations",
                "activation offload (CPU staging)",
                "set it false",
            ));
        }
        Ok(vec![
            Box::new(LrUpdaterHook::new(self.lr_schedule())?),
            Box::new(SnapshotHook::from_config(
                &self.checkpoint_config,
                self.runner.by_epoch(),
            )),
            Box::new(LoggerHook::new(self.log_config.interval)),
            Box::new(RunChoices {
                unused_with_cp: self.unused_with_cp,
            }),
        ])
    }
}

/// Puts the config's choices for the run in its context before the first step.
struct RunChoices {
    unused_with_cp: crate::checkpoint::UnusedWithCp,
}

impl<M: TrainModel> Hook<M> for RunChoices {
    fn name(&self) -> &'static str {
        "run_choices"
    }

    fn before_run(&mut self, _state: &mut TrainState<M>) -> Result<()> {
        memsave_common::checkpoint::set_unused_with_cp(self.unused_with_cp);
        Ok(())
    }
}
