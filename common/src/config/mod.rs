//! The TOML configuration, with MMCV's section and switch names:
//!
//! ```toml
//! [fp16]
//! loss_scale = 512.0            # or "dynamic", or { init_scale = 65536.0, growth_interval = 2000 }
//!
//! [optimizer_config]
//! type = "GradientCumulativeOptimizerHook"
//! cumulative_iters = 2
//! grad_clip = { max_norm = 35.0, norm_type = 2.0 }
//!
//! [model.backbone]
//! with_cp = true
//! ```
//!
//! `_base_` includes other files and `--set key=value` overrides any key ([`file`]); each
//! section deserialises into its runtime type where one exists (`sections` holds the rest),
//! with exactly one default per setting, the type's own; `build` makes the runner's parts.
//! An unknown key or type is an error that names it and suggests the closest valid one, a
//! value of the wrong type one that names the key and the type wanted (`explain`); a value
//! from `--set` is blamed on that argument. The `model` and `data` sections belong to the
//! models (type parameters here).

mod build;
mod explain;
mod file;
mod memory;
mod offload;
mod sections;

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;

pub use memory::{available_host_memory, Bandwidth, MemorySection, DEFAULT_HOST_SHARE};
pub use offload::{Bytes, OffloadSection};
pub use sections::{
    EvaluationSection, Fp16Section, GradScalerParams, LossScaleSpec, OptimizerHookSection,
    OptimizerHookType, OptimizerSection,
};

use crate::train::RunLength;
use crate::train::{LogConfig, LrSchedule, SnapshotConfig};
use crate::{Error, Result};

/// Where a model's own settings are in its config (defined with the planner, which speaks them
/// in its advice).
pub use crate::planner::ModelKeys;

/// A whole configuration; `M` and `D` are the schemas of the `model` and `data` sections.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config<M, D> {
    /// Where snapshots and logs go (default: `work_dirs/<config name>`).
    #[serde(default)]
    pub work_dir: Option<PathBuf>,
    /// Seed of the backend's random numbers (initial weights).
    #[serde(default)]
    pub seed: u64,
    /// The model.
    pub model: M,
    /// The training data.
    pub data: D,
    /// The optimizer.
    pub optimizer: OptimizerSection,
    /// The optimizer hook: plain, accumulation; clipping.
    #[serde(default)]
    pub optimizer_config: OptimizerHookSection,
    /// Mixed precision; absent: fp32.
    #[serde(default)]
    pub fp16: Option<Fp16Section>,
    /// The learning-rate schedule (its base rate is `optimizer.lr`).
    #[serde(default)]
    pub lr_config: LrSchedule,
    /// How long to train.
    pub runner: RunLength,
    /// When to save snapshots.
    #[serde(default)]
    pub checkpoint_config: SnapshotConfig,
    /// How often to log.
    #[serde(default)]
    pub log_config: LogConfig,
    /// Evaluation during training (MMDetection's `evaluation = dict(interval=1,
    /// metric='mAP')`); absent: none.
    #[serde(default)]
    pub evaluation: Option<EvaluationSection>,
    /// What a step must fit in (`memory_budget`), for `with_cp = "auto"`.
    #[serde(default)]
    pub memory: MemorySection,
    /// What goes to host memory (CPU staging); absent: nothing.
    #[serde(default)]
    pub offload: OffloadSection,
    /// What the run does when a module's `with_cp` switch is on but no `#[with_cp]` method of
    /// it ran in the first step: `"error"` (the default: the run stops, naming the types) or
    /// `"warn"` (a warning, and the run goes on without checkpointing them).
    #[serde(default)]
    pub unused_with_cp: crate::checkpoint::UnusedWithCp,
}

impl<M: DeserializeOwned, D: DeserializeOwned> Config<M, D> {
    /// Reads `path` (and the files its `_base_` names), applies `overrides` (`key=value`, TOML
    /// values), and checks the result.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let table = file::read_with_bases(path, &mut Vec::new())?;
        Self::from_table(table, path, overrides)
    }

    /// Parses `text` (`path` names it in errors; `_base_` is not followed).
    pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<Self> {
        let table: toml::Table = toml::from_str(text).map_err(|e| file::not_toml(path, e))?;
        Self::from_table(table, path, overrides)
    }

    fn from_table(mut table: toml::Table, path: &Path, overrides: &[String]) -> Result<Self> {
        table.remove("_base_");
        let applied = overrides
            .iter()
            .map(|assignment| file::apply_override(&mut table, assignment))
            .collect::<Result<Vec<_>>>()?;
        // A message about `key` is blamed on the `--set` that wrote it, if one did; `source`:
        // the deserialiser's error, where it found the fault.
        let blame = |key: &str, message: String, source: Option<toml::de::Error>| {
            let set = applied.iter().rev().find(|o| {
                key == o.key
                    || key.starts_with(&format!("{}.", o.key))
                    || o.key.starts_with(&format!("{key}."))
            });
            match set {
                Some(set) => Error::Override {
                    argument: set.argument.clone(),
                    message,
                    source,
                },
                None => Error::Config {
                    path: path.to_path_buf(),
                    message,
                    source,
                },
            }
        };
        let mut config: Self = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| {
                let key = e.path().to_string();
                let inner = e.into_inner();
                let message = explain::explain(key.clone(), inner.to_string());
                blame(&key, message, Some(inner))
            })?;
        config.lr_config.base_lr = config.optimizer.lr;
        config.validate().map_err(|e| match e {
            Error::InvalidValue { field, message } => {
                blame(&field, format!("`{field}`: {message}"), None)
            }
            other => other,
        })?;
        Ok(config)
    }
}

/// `error` from a runtime type's check, with its parameter put under the config's `section`.
fn under(section: &str, error: Error) -> Error {
    error.within(section)
}
