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
//! `--set key=value` overrides any key (`--set optimizer_config.cumulative_iters=4`). An unknown
//! key or type is an error that names it and suggests the closest valid one; a value of the
//! wrong type is an error that names the key and the expected type. The `model` and `data`
//! sections belong to the models (type parameters here).

use std::path::{Path, PathBuf};

use serde::de::{DeserializeOwned, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::fp16::Precision;
use crate::hooks::{
    CheckpointHook, Fp16OptimizerHook, GradClip, GradientCumulativeFp16OptimizerHook,
    GradientCumulativeOptimizerHook, LoggerHook, LrSchedule, LrUpdaterHook, OptimizerHook,
    StepPolicy, Warmup,
};
use crate::scaler::{LossScaler, ScaleMode};
use crate::train::{Hook, OptimizerKind, RunLength, TrainModel};
use crate::{Error, Result};
use burn::tensor::backend::AutodiffBackend;

/// A whole configuration; `M` and `D` are the schemas of the `model` and `data` sections.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config<M, D> {
    /// Where checkpoints and logs go (default: `work_dirs/<config name>`).
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
    /// The learning-rate schedule.
    #[serde(default)]
    pub lr_config: LrSection,
    /// How long to train.
    pub runner: RunnerSection,
    /// When to save checkpoints.
    #[serde(default)]
    pub checkpoint_config: CheckpointSection,
    /// How often to log.
    #[serde(default)]
    pub log_config: LogSection,
}

/// `[optimizer]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    /// `SGD`, `Adam` or `AdamW`.
    #[serde(rename = "type")]
    pub kind: OptimizerType,
    /// The base learning rate.
    pub lr: f64,
    /// SGD's momentum.
    #[serde(default)]
    pub momentum: f64,
    /// Weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// SGD's Nesterov momentum.
    #[serde(default)]
    pub nesterov: bool,
    /// Adam's and AdamW's `(beta1, beta2)`.
    #[serde(default = "default_betas")]
    pub betas: (f64, f64),
    /// Adam's and AdamW's epsilon.
    #[serde(default = "default_eps")]
    pub eps: f64,
}

fn default_betas() -> (f64, f64) {
    (0.9, 0.999)
}

fn default_eps() -> f64 {
    1e-8
}

/// The optimizers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum OptimizerType {
    /// Stochastic gradient descent.
    #[serde(rename = "SGD")]
    Sgd,
    /// Adam.
    Adam,
    /// AdamW.
    AdamW,
}

/// `[optimizer_config]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerHookSection {
    /// `OptimizerHook` (default) or `GradientCumulativeOptimizerHook`; with `[fp16]`, the fp16
    /// variant of either is used.
    #[serde(rename = "type", default = "default_hook")]
    pub kind: OptimizerHookType,
    /// Micro-batches per optimizer step (accumulation only).
    #[serde(default)]
    pub cumulative_iters: Option<usize>,
    /// Global-norm gradient clipping.
    #[serde(default)]
    pub grad_clip: Option<GradClipSection>,
    /// Report trainable parameters without a gradient.
    #[serde(default)]
    pub detect_anomalous_params: bool,
}

impl Default for OptimizerHookSection {
    fn default() -> Self {
        OptimizerHookSection {
            kind: OptimizerHookType::OptimizerHook,
            cumulative_iters: None,
            grad_clip: None,
            detect_anomalous_params: false,
        }
    }
}

fn default_hook() -> OptimizerHookType {
    OptimizerHookType::OptimizerHook
}

/// The optimizer hooks, by MMCV's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum OptimizerHookType {
    /// Backward, clip, step.
    OptimizerHook,
    /// Mixed precision (also chosen by an `[fp16]` section).
    Fp16OptimizerHook,
    /// Gradient accumulation.
    GradientCumulativeOptimizerHook,
    /// Accumulation under mixed precision.
    GradientCumulativeFp16OptimizerHook,
}

/// `grad_clip = { max_norm = 35.0, norm_type = 2.0 }`.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GradClipSection {
    /// The largest global norm allowed.
    pub max_norm: f64,
    /// The norm's `p`.
    #[serde(default = "default_norm_type")]
    pub norm_type: f64,
}

fn default_norm_type() -> f64 {
    2.0
}

/// `[fp16]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp16Section {
    /// A number (static), `"dynamic"`, or a table of the scaler's parameters.
    #[serde(default = "default_loss_scale")]
    pub loss_scale: LossScaleSpec,
    /// `"f16"` (default) or `"bf16"`.
    #[serde(default)]
    pub precision: Precision,
}

fn default_loss_scale() -> LossScaleSpec {
    LossScaleSpec::Static(512.0)
}

/// The forms of `fp16.loss_scale`.
#[derive(Clone, Debug, PartialEq)]
pub enum LossScaleSpec {
    /// A fixed scale: `loss_scale = 512.0` (an integer is accepted).
    Static(f64),
    /// `loss_scale = "dynamic"`: PyTorch's `GradScaler` defaults.
    Dynamic,
    /// `loss_scale = { ... }`: the scaler's parameters.
    Table(LossScaleTable),
}

/// The table form, with PyTorch's `GradScaler` names (and MMCV's `LossScaler` names as aliases).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossScaleTable {
    /// Starting scale (default 65536).
    #[serde(default = "default_init_scale")]
    pub init_scale: f64,
    /// `"dynamic"` (default) or `"static"`.
    #[serde(default = "default_mode")]
    pub mode: ScaleMode,
    /// Growth factor (MMCV: `scale_factor`; default 2).
    #[serde(default = "default_factor", alias = "scale_factor")]
    pub growth_factor: f64,
    /// Back-off factor on overflow (default `1 / growth_factor`).
    #[serde(default)]
    pub backoff_factor: Option<f64>,
    /// Clean iterations before growing (MMCV: `scale_window`; default 2000).
    #[serde(default = "default_interval", alias = "scale_window")]
    pub growth_interval: u64,
}

fn default_init_scale() -> f64 {
    65536.0
}
fn default_mode() -> ScaleMode {
    ScaleMode::Dynamic
}
fn default_factor() -> f64 {
    2.0
}
fn default_interval() -> u64 {
    2000
}

impl<'de> Deserialize<'de> for LossScaleSpec {
    fn deserialize<De: Deserializer<'de>>(
        deserializer: De,
    ) -> std::result::Result<Self, De::Error> {
        struct Spec;
        impl<'de> Visitor<'de> for Spec {
            type Value = LossScaleSpec;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number, \"dynamic\", or a table of the scaler's parameters")
            }

            fn visit_f64<E: serde::de::Error>(
                self,
                value: f64,
            ) -> std::result::Result<Self::Value, E> {
                Ok(LossScaleSpec::Static(value))
            }

            fn visit_i64<E: serde::de::Error>(
                self,
                value: i64,
            ) -> std::result::Result<Self::Value, E> {
                Ok(LossScaleSpec::Static(value as f64))
            }

            fn visit_u64<E: serde::de::Error>(
                self,
                value: u64,
            ) -> std::result::Result<Self::Value, E> {
                Ok(LossScaleSpec::Static(value as f64))
            }

            fn visit_str<E: serde::de::Error>(
                self,
                value: &str,
            ) -> std::result::Result<Self::Value, E> {
                if value == "dynamic" {
                    Ok(LossScaleSpec::Dynamic)
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Str(value), &self))
                }
            }

            fn visit_map<A: MapAccess<'de>>(
                self,
                map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                LossScaleTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(LossScaleSpec::Table)
            }
        }
        deserializer.deserialize_any(Spec)
    }
}

impl LossScaleSpec {
    /// The scaler it describes; errors name the key under `fp16.loss_scale`.
    pub fn scaler(&self) -> Result<LossScaler> {
        let key = |parameter: &str| match (self, parameter) {
            (LossScaleSpec::Table(_), "init_scale") => "fp16.loss_scale.init_scale".to_string(),
            (LossScaleSpec::Table(_), "scale_factor") => {
                "fp16.loss_scale.growth_factor".to_string()
            }
            (LossScaleSpec::Table(_), "scale_window") => {
                "fp16.loss_scale.growth_interval".to_string()
            }
            (LossScaleSpec::Table(_), other) => format!("fp16.loss_scale.{other}"),
            _ => "fp16.loss_scale".to_string(),
        };
        let scaler = match self {
            LossScaleSpec::Static(scale) => LossScaler::fixed(*scale),
            LossScaleSpec::Dynamic => LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2000),
            LossScaleSpec::Table(table) => LossScaler::new(
                table.init_scale,
                table.mode,
                table.growth_factor,
                table.growth_interval,
            )
            .and_then(|scaler| match table.backoff_factor {
                Some(backoff) => scaler.with_backoff_factor(backoff),
                None => Ok(scaler),
            }),
        };
        scaler.map_err(|error| match error {
            Error::InvalidValue { field, message } => Error::invalid(key(&field), message),
            other => other,
        })
    }
}

/// `[lr_config]` (MMDetection's `lr_config = dict(policy='step', warmup='linear', ...)`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSection {
    /// `"step"` or `"fixed"`.
    #[serde(default = "default_policy")]
    pub policy: LrPolicy,
    /// Milestones (epochs, or iterations with `by_epoch = false`).
    #[serde(default)]
    pub step: Vec<usize>,
    /// Decay at each milestone.
    #[serde(default = "default_gamma")]
    pub gamma: f64,
    /// `"linear"`, `"constant"` or `"exp"`; absent: none.
    #[serde(default)]
    pub warmup: Option<WarmupType>,
    /// Warm-up iterations.
    #[serde(default)]
    pub warmup_iters: usize,
    /// The warm-up's starting fraction.
    #[serde(default = "default_warmup_ratio")]
    pub warmup_ratio: f64,
    /// Milestones in epochs (default: as the runner).
    #[serde(default)]
    pub by_epoch: Option<bool>,
}

impl Default for LrSection {
    fn default() -> Self {
        LrSection {
            policy: LrPolicy::Fixed,
            step: Vec::new(),
            gamma: 0.1,
            warmup: None,
            warmup_iters: 0,
            warmup_ratio: 0.1,
            by_epoch: None,
        }
    }
}

fn default_policy() -> LrPolicy {
    LrPolicy::Step
}
fn default_gamma() -> f64 {
    0.1
}
fn default_warmup_ratio() -> f64 {
    0.1
}

/// The decay policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrPolicy {
    /// Decay by `gamma` at each milestone.
    Step,
    /// Constant.
    Fixed,
}

/// The warm-ups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    /// From `ratio * lr` to `lr`, linearly.
    Linear,
    /// `ratio * lr` throughout.
    Constant,
    /// From `ratio * lr` to `lr`, exponentially.
    Exp,
}

/// `[runner]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunnerSection {
    /// `EpochBasedRunner` or `IterBasedRunner`.
    #[serde(rename = "type")]
    pub kind: RunnerType,
    /// Epochs (epoch-based).
    #[serde(default)]
    pub max_epochs: Option<usize>,
    /// Iterations (iteration-based).
    #[serde(default)]
    pub max_iters: Option<usize>,
}

/// The runners.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum RunnerType {
    /// Counted in epochs.
    EpochBasedRunner,
    /// Counted in iterations.
    IterBasedRunner,
}

/// `[checkpoint_config]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every this many epochs (or iterations); 0: only at the end.
    #[serde(default = "one")]
    pub interval: usize,
    /// Count the interval in epochs (default: as the runner).
    #[serde(default)]
    pub by_epoch: Option<bool>,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            interval: 1,
            by_epoch: None,
        }
    }
}

fn one() -> usize {
    1
}

/// `[log_config]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSection {
    /// Iterations between log lines.
    #[serde(default = "fifty")]
    pub interval: usize,
}

impl Default for LogSection {
    fn default() -> Self {
        LogSection { interval: 50 }
    }
}

fn fifty() -> usize {
    50
}

impl<M: DeserializeOwned, D: DeserializeOwned> Config<M, D> {
    /// Reads `path` (and the files its `_base_` names), applies `overrides` (`key=value`, TOML
    /// values), and checks the result.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let table = read_with_bases(path, &mut Vec::new())?;
        Self::from_table(table, path, overrides)
    }

    /// Parses `text` (`path` names it in errors; `_base_` is not followed).
    pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<Self> {
        let table: toml::Table = toml::from_str(text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::from_table(table, path, overrides)
    }

    fn from_table(mut table: toml::Table, path: &Path, overrides: &[String]) -> Result<Self> {
        let error = |message: String| Error::Config {
            path: path.to_path_buf(),
            message,
        };
        table.remove("_base_");
        for assignment in overrides {
            apply_override(&mut table, assignment).map_err(&error)?;
        }
        let config: Self = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| error(explain(e.path().to_string(), e.into_inner().to_string())))?;
        config.validate().map_err(|e| match e {
            Error::InvalidValue { field, message } => error(format!("`{field}`: {message}")),
            other => other,
        })?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        let hook = &self.optimizer_config;
        let cumulative = matches!(
            hook.kind,
            OptimizerHookType::GradientCumulativeOptimizerHook
                | OptimizerHookType::GradientCumulativeFp16OptimizerHook
        );
        match (cumulative, hook.cumulative_iters) {
            (false, Some(_)) => {
                return Err(Error::invalid(
                    "optimizer_config.cumulative_iters",
                    "only GradientCumulativeOptimizerHook takes it: set \
                     `optimizer_config.type = \"GradientCumulativeOptimizerHook\"`",
                ))
            }
            (true, Some(0)) => {
                return Err(Error::invalid(
                    "optimizer_config.cumulative_iters",
                    "expected a positive integer, got 0",
                ))
            }
            _ => {}
        }
        if let Some(clip) = &hook.grad_clip {
            GradClip::new(clip.max_norm, clip.norm_type)?;
        }
        if let Some(fp16) = &self.fp16 {
            fp16.loss_scale.scaler()?;
        }
        self.lr_schedule().validate()?;
        self.run_length()?;
        Ok(())
    }

    /// The optimizer.
    pub fn optimizer_kind(&self) -> OptimizerKind {
        let o = &self.optimizer;
        match o.kind {
            OptimizerType::Sgd => OptimizerKind::Sgd {
                momentum: o.momentum,
                weight_decay: o.weight_decay,
                nesterov: o.nesterov,
            },
            OptimizerType::Adam => OptimizerKind::Adam {
                betas: o.betas,
                eps: o.eps,
                weight_decay: o.weight_decay,
            },
            OptimizerType::AdamW => OptimizerKind::AdamW {
                betas: o.betas,
                eps: o.eps,
                weight_decay: o.weight_decay,
            },
        }
    }

    /// How long the run is.
    pub fn run_length(&self) -> Result<RunLength> {
        let r = &self.runner;
        match (r.kind, r.max_epochs, r.max_iters) {
            (RunnerType::EpochBasedRunner, Some(epochs), None) if epochs > 0 => {
                Ok(RunLength::Epochs(epochs))
            }
            (RunnerType::IterBasedRunner, None, Some(iters)) if iters > 0 => {
                Ok(RunLength::Iters(iters))
            }
            (RunnerType::EpochBasedRunner, _, _) => Err(Error::invalid(
                "runner.max_epochs",
                "an EpochBasedRunner needs `max_epochs` (a positive integer) and no `max_iters`",
            )),
            (RunnerType::IterBasedRunner, _, _) => Err(Error::invalid(
                "runner.max_iters",
                "an IterBasedRunner needs `max_iters` (a positive integer) and no `max_epochs`",
            )),
        }
    }

    fn by_epoch(&self) -> bool {
        self.runner.kind == RunnerType::EpochBasedRunner
    }

    /// The learning-rate schedule.
    pub fn lr_schedule(&self) -> LrSchedule {
        let lr = &self.lr_config;
        LrSchedule {
            base_lr: self.optimizer.lr,
            policy: match lr.policy {
                LrPolicy::Fixed => StepPolicy::Fixed,
                LrPolicy::Step => StepPolicy::Step {
                    steps: lr.step.clone(),
                    gamma: lr.gamma,
                },
            },
            by_epoch: lr.by_epoch.unwrap_or(self.by_epoch()),
            warmup: lr.warmup.map(|warmup| match warmup {
                WarmupType::Linear => Warmup::Linear,
                WarmupType::Constant => Warmup::Constant,
                WarmupType::Exp => Warmup::Exp,
            }),
            warmup_iters: lr.warmup_iters,
            warmup_ratio: lr.warmup_ratio,
        }
    }

    /// The optimizer hook: the configured type, made mixed-precision by an `[fp16]` section.
    pub fn optimizer_hook<B: AutodiffBackend, Mo: TrainModel<B>>(
        &self,
    ) -> Result<Box<dyn Hook<B, Mo>>> {
        let section = &self.optimizer_config;
        let clip = section
            .grad_clip
            .map(|clip| GradClip::new(clip.max_norm, clip.norm_type))
            .transpose()?;
        let detect = section.detect_anomalous_params;
        let cumulative_iters = section.cumulative_iters.unwrap_or(1);
        let fp16 = match (&self.fp16, section.kind) {
            (Some(fp16), _) => Some(fp16.clone()),
            (None, OptimizerHookType::Fp16OptimizerHook)
            | (None, OptimizerHookType::GradientCumulativeFp16OptimizerHook) => Some(Fp16Section {
                loss_scale: default_loss_scale(),
                precision: Precision::F16,
            }),
            (None, _) => None,
        };
        let cumulative = matches!(
            section.kind,
            OptimizerHookType::GradientCumulativeOptimizerHook
                | OptimizerHookType::GradientCumulativeFp16OptimizerHook
        );
        Ok(match (fp16, cumulative) {
            (None, false) => Box::new(OptimizerHook {
                grad_clip: clip,
                detect_anomalous_params: detect,
            }),
            (None, true) => {
                let mut hook = GradientCumulativeOptimizerHook::new(cumulative_iters)?;
                hook.grad_clip = clip;
                hook.detect_anomalous_params = detect;
                Box::new(hook)
            }
            (Some(fp16), false) => {
                let mut hook = Fp16OptimizerHook::new(fp16.loss_scale.scaler()?);
                hook.grad_clip = clip;
                hook.precision = fp16.precision;
                hook.detect_anomalous_params = detect;
                Box::new(hook)
            }
            (Some(fp16), true) => {
                let mut hook = GradientCumulativeFp16OptimizerHook::new(
                    cumulative_iters,
                    fp16.loss_scale.scaler()?,
                )?;
                hook.grad_clip = clip;
                hook.precision = fp16.precision;
                hook.detect_anomalous_params = detect;
                Box::new(hook)
            }
        })
    }

    /// The other hooks: learning rate, checkpoints, log.
    pub fn hooks<B: AutodiffBackend, Mo: TrainModel<B>>(&self) -> Vec<Box<dyn Hook<B, Mo>>> {
        vec![
            Box::new(LrUpdaterHook {
                schedule: self.lr_schedule(),
            }),
            Box::new(CheckpointHook::new(
                self.checkpoint_config.interval,
                self.checkpoint_config.by_epoch.unwrap_or(self.by_epoch()),
            )),
            Box::new(LoggerHook::new(self.log_config.interval)),
        ]
    }
}

/// The TOML table of `path`, over the tables of the files its `_base_` names (MMCV's config
/// inheritance: `_base_ = "base.toml"` or a list; paths relative to the file; later bases and
/// the file itself win, table by table).
fn read_with_bases(path: &Path, chain: &mut Vec<PathBuf>) -> Result<toml::Table> {
    let error = |message: String| Error::Config {
        path: path.to_path_buf(),
        message,
    };
    let canonical = path.canonicalize().map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if chain.contains(&canonical) {
        return Err(error("`_base_` files include each other in a cycle".into()));
    }
    chain.push(canonical);
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| error(e.to_string()))?;
    let bases = match table.remove("_base_") {
        None => Vec::new(),
        Some(toml::Value::String(base)) => vec![base],
        Some(toml::Value::Array(bases)) => bases
            .into_iter()
            .map(|base| match base {
                toml::Value::String(base) => Ok(base),
                other => Err(error(format!(
                    "`_base_`: expected file names, found {}",
                    other.type_str()
                ))),
            })
            .collect::<Result<_>>()?,
        Some(other) => {
            return Err(error(format!(
                "`_base_`: expected a file name or a list of them, found {}",
                other.type_str()
            )))
        }
    };
    let directory = path.parent().unwrap_or(Path::new("."));
    let mut merged = toml::Table::new();
    for base in bases {
        merge(&mut merged, read_with_bases(&directory.join(base), chain)?);
    }
    merge(&mut merged, table);
    chain.pop();
    Ok(merged)
}

/// `over` onto `base`: tables merge key by key, anything else replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(into)), toml::Value::Table(from)) => merge(into, from),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// `a.b.c=value` into `table`: the value is read as TOML (`4`, `2.5`, `true`, `"text"`,
/// `[1, 2]`, `{ max_norm = 35 }`), or taken as a string when it is not TOML.
fn apply_override(table: &mut toml::Table, assignment: &str) -> std::result::Result<(), String> {
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| format!("`--set {assignment}`: expected `key=value`"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(format!("`--set {assignment}`: `{key}` is not a dotted key"));
    }
    let value = match toml::from_str::<toml::Table>(&format!("value = {value}")) {
        Ok(mut parsed) => parsed.remove("value").expect("just parsed"),
        Err(_) => toml::Value::String(value.to_string()),
    };
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().expect("at least one part");
    let mut current = table;
    let mut walked = Vec::new();
    for part in parts {
        walked.push(part);
        let entry = current
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        current = entry.as_table_mut().ok_or_else(|| {
            format!(
                "`--set {assignment}`: `{}` is not a table",
                walked.join(".")
            )
        })?;
    }
    current.insert(last.to_string(), value);
    Ok(())
}

/// serde's message, with the key and, for a misspelt key or type, the closest valid one.
fn explain(path: String, message: String) -> String {
    let key = if path == "." { String::new() } else { path };
    // The TOML deserializer adds its own "in `key`" line: the path says it already.
    let message = message
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    let (what, rest) = if let Some(rest) = message.strip_prefix("unknown field `") {
        ("key", rest)
    } else if let Some(rest) = message.strip_prefix("unknown variant `") {
        ("type", rest)
    } else {
        let message = message
            .replace("expected usize", "expected a non-negative integer")
            .replace("expected u64", "expected a non-negative integer")
            .replace("expected f64", "expected a number");
        return if key.is_empty() {
            message
        } else {
            format!("`{key}`: {message}")
        };
    };
    let (name, expected) = rest.split_once('`').unwrap_or((rest, ""));
    let candidates: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    let full = if what == "key" && (key == name || key.ends_with(&format!(".{name}"))) {
        key.clone()
    } else if what == "key" && !key.is_empty() {
        format!("{key}.{name}")
    } else if what == "key" {
        name.to_string()
    } else {
        format!("{key} = \"{name}\"")
    };
    let suggestion = candidates
        .iter()
        .map(|candidate| (strsim::damerau_levenshtein(name, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= (candidate.len() / 3).max(2))
        .min_by_key(|(distance, _)| *distance);
    match suggestion {
        Some((_, close)) => format!("unknown {what} `{full}`; did you mean `{close}`?"),
        None => format!(
            "unknown {what} `{full}`; expected one of {}",
            candidates
                .iter()
                .map(|c| format!("`{c}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
