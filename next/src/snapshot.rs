//! Snapshots of a training run on Burn 0.22 (MMCV's checkpoint files, `--resume`): the model's
//! parameters and running statistics, the optimizer's state, each hook's state (the loss
//! scaler, ...) and the position in the run, in one file. ("Checkpoint" in memsave's code means
//! recomputation, as in `torch.utils.checkpoint`.)
//!
//! The file is memsave's container (memsave-common's `snapshot`, format [`FORMAT`]): a JSON
//! header ([`SnapshotMeta`]), the model as Burn 0.22's burnpack bytes (`Module::into_record`,
//! the parameter ids kept, so that the optimizer's state finds its parameters again), the
//! optimizer's burnpack bytes (`ModuleOptimizer::into_bytes`), a CRC32 over all of it. It is
//! written to a temporary sibling, synced and renamed over the target, so a crash leaves the
//! previous file whole. A damaged or truncated file, one of another model, an optimizer state
//! the optimizer cannot read, and a snapshot written by memsave on Burn 0.21 (whose records Burn
//! 0.22 cannot read) are each an error naming the file, never a panic.
//!
//! ```
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::AdamConfig;
//! use burn::prelude::*;
//! use memsave_next::snapshot::Snapshot;
//!
//! let device = Device::flex().autodiff();
//! let model: Linear = LinearConfig::new(4, 2).init(&device);
//! let optimizer = AdamConfig::new().init();
//! let path = std::env::temp_dir().join(format!("memsave-doc-{}.ckpt", std::process::id()));
//! Snapshot::new(10, 1)
//!     .with_model(&model)?
//!     .with_optimizer(&optimizer)?
//!     .save(&path)?;
//!
//! // Resuming: a model and optimizer built as before, the snapshot's state loaded into them.
//! let fresh: Linear = LinearConfig::new(4, 2).init(&device);
//! let snapshot = Snapshot::load(&path)?;
//! let (model, optimizer) = snapshot.restore(fresh, AdamConfig::new().init())?;
//! assert_eq!(snapshot.meta.iter, 10);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), memsave_next::Error>(())
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::store::{ModuleRecord, RecordError};
use burn::tensor::{Bytes, Tensor};
use serde::{Deserialize, Serialize};

use memsave_common::snapshot::{self as format, bad_snapshot};
pub use memsave_common::snapshot::{FormatError, SnapshotCause, MAGIC};
use memsave_common::{Error, Result};

/// The version of the format memsave on Burn 0.22 writes and reads.
pub const FORMAT: u32 = format::FORMAT_BURN_0_22;

/// The Burn whose records a snapshot of this memsave holds.
pub const BURN_VERSION: &str = "0.22.1";

/// The header of a snapshot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotMeta {
    /// The memsave version that wrote it.
    pub memsave_version: String,
    /// The Burn version whose records it holds.
    pub burn_version: String,
    /// Completed iterations: the run resumes at this one.
    pub iter: usize,
    /// The epoch of `iter`.
    pub epoch: usize,
    /// The shape of every float parameter (running statistics included), in the module's
    /// order: a snapshot only loads into the same model.
    pub param_shapes: Vec<Vec<usize>>,
    /// The precision it trained in (`"fp32"`, `"f16"`, `"bf16"`), where the writer said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// Each hook's state, by hook name (the loss scaler's under `"fp16"`).
    pub hooks: BTreeMap<String, serde_json::Value>,
}

/// A snapshot in memory: what [`Snapshot::save`] writes and [`Snapshot::load`] reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// The header.
    pub meta: SnapshotMeta,
    /// The model's burnpack bytes (empty until [`with_model`](Self::with_model)).
    pub model: Vec<u8>,
    /// The optimizer's burnpack bytes (empty until [`with_optimizer`](Self::with_optimizer)).
    pub optimizer: Vec<u8>,
    /// The file it was read from, which its errors name.
    path: Option<PathBuf>,
}

impl Snapshot {
    /// An empty snapshot at `iter` completed iterations, in `epoch`.
    pub fn new(iter: usize, epoch: usize) -> Self {
        Snapshot {
            meta: SnapshotMeta {
                memsave_version: env!("CARGO_PKG_VERSION").to_string(),
                burn_version: BURN_VERSION.to_string(),
                iter,
                epoch,
                param_shapes: Vec::new(),
                precision: None,
                hooks: BTreeMap::new(),
            },
            model: Vec::new(),
            optimizer: Vec::new(),
            path: None,
        }
    }

    /// With `model`'s parameters and running statistics, in the dtype each has (fp32 masters
    /// stay fp32; 16-bit weights stay 16-bit), and their ids.
    pub fn with_model<M: Module>(mut self, model: &M) -> Result<Self> {
        // `valid()` first: a running statistic's last update waits, per thread, until its next
        // read merges it (burn-core `module/param/running.rs`), and a module's visit reads the
        // value without merging; `valid()` merges every one (the same ids, no autodiff).
        let model = model.valid();
        self.meta.param_shapes = param_shapes(&model);
        let bytes = model
            .into_record()
            .into_bytes()
            .map_err(|error| self.bad(codec("the model's record could not be written", error)))?;
        self.model = bytes.to_vec();
        Ok(self)
    }

    /// With `optimizer`'s state (every parameter's, keyed by parameter id).
    pub fn with_optimizer(mut self, optimizer: &ModuleOptimizer) -> Result<Self> {
        let bytes = optimizer.into_bytes().map_err(|error| {
            self.bad(codec("the optimizer's state could not be written", error))
        })?;
        self.optimizer = bytes.to_vec();
        Ok(self)
    }

    /// With the precision it trained in (`"fp32"`, `"f16"`, `"bf16"`).
    pub fn with_precision(mut self, precision: impl Into<String>) -> Self {
        self.meta.precision = Some(precision.into());
        self
    }

    /// With a hook's state under `name` (the loss scaler: `with_hook("fp16", amp.scaler())`).
    pub fn with_hook(mut self, name: &str, state: &impl Serialize) -> Result<Self> {
        let value = serde_json::to_value(state)
            .map_err(|error| Error::state(format!("the state of hook `{name}`"), error))?;
        self.meta.hooks.insert(name.to_string(), value);
        Ok(self)
    }

    /// The state of hook `name`, where the snapshot holds one.
    pub fn hook(&self, name: &str) -> Option<&serde_json::Value> {
        self.meta.hooks.get(name)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let meta =
            serde_json::to_vec(&self.meta).map_err(|error| self.bad(FormatError::Header(error)))?;
        Ok(format::encode_sections(
            FORMAT,
            &[&meta, &self.model, &self.optimizer],
        ))
    }

    /// Parses a file's bytes; `path` names the file in errors. A snapshot written by memsave on
    /// Burn 0.21 is refused naming the version that wrote it.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |error: FormatError| bad_snapshot(path, error);
        let sections = format::decode_sections(
            bytes,
            FORMAT,
            &["header section", "model section", "optimizer section"],
        )
        .map_err(bad)?;
        if sections.len() > 3 {
            return Err(bad(FormatError::Extra(sections.len() - 3)));
        }
        let meta: SnapshotMeta =
            serde_json::from_slice(sections[0]).map_err(|error| bad(FormatError::Header(error)))?;
        Ok(Snapshot {
            meta,
            model: sections[1].to_vec(),
            optimizer: sections[2].to_vec(),
            path: Some(path.to_path_buf()),
        })
    }

    /// Writes the snapshot to `path` atomically (a temporary sibling, synced, renamed).
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = self.to_bytes().map_err(|error| match error {
            Error::Snapshot {
                message, source, ..
            } => Error::Snapshot {
                path: path.to_path_buf(),
                message,
                source,
            },
            other => other,
        })?;
        format::write_atomically(path, &bytes)
    }

    /// Reads and checks the snapshot at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes, path)
    }

    /// `model` with the snapshot's parameters, running statistics and parameter ids. The model
    /// must have the snapshot's parameters (their shapes are checked first, then Burn's record
    /// checks every path); their dtypes come from the snapshot.
    pub fn load_model<M: Module>(&self, model: M) -> Result<M> {
        if self.model.is_empty() {
            return Err(self.bad_message("it holds no model"));
        }
        let here = param_shapes(&model);
        if here != self.meta.param_shapes {
            let (there, ours) = (self.meta.param_shapes.len(), here.len());
            let first = self
                .meta
                .param_shapes
                .iter()
                .zip(&here)
                .position(|(a, b)| a != b)
                .map_or(String::new(), |i| {
                    format!(
                        "; parameter {i} is {:?} there and {:?} here",
                        self.meta.param_shapes[i], here[i]
                    )
                });
            return Err(self.bad_message(format!(
                "it was saved from another model ({there} parameters there, {ours} here{first})"
            )));
        }
        let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(self.model.clone()))
            .map_err(|error| self.bad(codec("the model's record is unreadable", error)))?;
        model
            .try_load_record(record)
            .map_err(|error| self.bad(codec("the model's record does not fit the model", error)))
    }

    /// `optimizer` with the snapshot's state. Burn's `load_record` drops a parameter's state it
    /// cannot read, which would restart that parameter's moments without a word: a state whose
    /// tensors this optimizer does not read (another optimizer's, Adam's against SGD's momentum,
    /// 8-bit against fp32) is an error naming how many it kept. What Burn reads without a
    /// tensor to show for it (SGD without momentum, whose state is empty) cannot be told apart:
    /// build the optimizer as the run that wrote the snapshot did. The states are keyed by
    /// parameter id: load the model from the same snapshot.
    pub fn load_optimizer(&self, optimizer: ModuleOptimizer) -> Result<ModuleOptimizer> {
        if self.optimizer.is_empty() {
            return Err(self.bad_message("it holds no optimizer state"));
        }
        let record = OptimizerRecord::from_bytes(Bytes::from_bytes_vec(self.optimizer.clone()))
            .map_err(|error| self.bad(codec("the optimizer's state is unreadable", error)))?;
        let saved = record.len();
        // Burn's load panics on a record tensor without a parameter id (a burnpack that is not
        // an optimizer's): a damaged snapshot is an error, never a panic.
        let optimizer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            optimizer.load_record(record)
        }))
        .map_err(|panic| {
            let why = memsave_common::panic_text(&*panic).unwrap_or("a panic");
            self.bad_message(format!(
                "the optimizer's state is not an optimizer's record ({why})"
            ))
        })?;
        let kept = optimizer.to_record().len();
        if kept < saved {
            return Err(self.bad_message(format!(
                "this optimizer reads {kept} of the {saved} state tensors saved there: the \
                 snapshot was written with another optimizer or other settings (momentum, \
                 8-bit or fp32 state, 16-bit weights); build the optimizer as the run that \
                 wrote it did"
            )));
        }
        Ok(optimizer)
    }

    /// The model and the optimizer of a resumed run: [`load_model`](Self::load_model), then
    /// [`load_optimizer`](Self::load_optimizer).
    pub fn restore<M: Module>(
        &self,
        model: M,
        optimizer: ModuleOptimizer,
    ) -> Result<(M, ModuleOptimizer)> {
        let model = self.load_model(model)?;
        let optimizer = self.load_optimizer(optimizer)?;
        Ok((model, optimizer))
    }

    fn file(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new("(in memory)"))
    }

    fn bad(&self, cause: impl Into<SnapshotCause>) -> Error {
        bad_snapshot(self.file(), cause)
    }

    fn bad_message(&self, message: impl Into<String>) -> Error {
        Error::snapshot(self.file(), message)
    }
}

/// `model` with the weights of the snapshot at `path` (a model trained with autodiff, loaded
/// for inference on any device): the parameters must be the snapshot's.
pub fn load_weights<M: Module>(model: M, path: &Path) -> Result<M> {
    Snapshot::load(path)?.load_model(model)
}

/// What Burn's record said, with what memsave was doing.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct CodecError {
    what: &'static str,
    #[source]
    source: RecordError,
}

fn codec(what: &'static str, source: RecordError) -> SnapshotCause {
    SnapshotCause::Codec(Box::new(CodecError { what, source }))
}

/// Every float parameter's shape, in `module`'s visiting order.
fn param_shapes<M: Module>(module: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl ModuleVisitor for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.lazy_shape().dims::<D>().to_vec());
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    shapes.0
}
