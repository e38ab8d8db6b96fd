//! Snapshots of a run on disk (MMCV's checkpoint files: `checkpoint_config`, `--resume`): the
//! model, the optimizer state, every hook's state (the loss scaler, the accumulation position)
//! and the position in the run. ("Checkpoint" in memsave's code means recomputation, as in
//! `torch.utils.checkpoint`.)
//!
//! Layout (memsave-common's container, format [`FORMAT`]): a JSON header, the model record,
//! the optimizer record and, with 16-bit weights, a fourth section, the weights' store (the step
//! count, Kahan's compensations). A file is written to a temporary sibling, synced, then renamed
//! over the target, so a crash leaves the previous snapshot whole; a truncated or corrupted file
//! is an error that names it, never a panic; one written by memsave on Burn 0.22 is refused
//! naming the version that wrote it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub mod codec;

pub(crate) use memsave_common::snapshot::bad_snapshot;
pub use memsave_common::snapshot::{
    temporary_path, write_atomically, FormatError, SnapshotCause, MAGIC,
};

/// The version of the format memsave on Burn 0.21 writes and reads.
pub const FORMAT: u32 = memsave_common::snapshot::FORMAT_BURN_0_21;

impl From<codec::CodecError> for SnapshotCause {
    fn from(error: codec::CodecError) -> Self {
        SnapshotCause::Codec(Box::new(error))
    }
}

/// The header of a snapshot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotMeta {
    /// The memsave version that wrote it.
    pub memsave_version: String,
    /// Completed iterations: the run resumes at this one.
    pub iter: usize,
    /// The epoch of `iter`.
    pub epoch: usize,
    /// The shape of every parameter, in order: a snapshot only loads into the same model.
    pub param_shapes: Vec<Vec<usize>>,
    /// The precision it trained in (`"fp32"`, `"f16"`, `"bf16"`); absent in older snapshots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// How its trainable weights were kept, where in 16 bits (absent: fp32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<crate::train::weights::WeightSpec>,
    /// Each hook's state, by hook name.
    pub hooks: BTreeMap<String, serde_json::Value>,
}

/// A snapshot in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// The header.
    pub meta: SnapshotMeta,
    /// The model record (full precision).
    pub model: Vec<u8>,
    /// The optimizer record.
    pub optimizer: Vec<u8>,
    /// The 16-bit weights' store ([`crate::train::WeightStore::to_bytes`]), where the weights
    /// were compressed.
    pub weights: Option<Vec<u8>>,
}

impl Snapshot {
    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let meta = serde_json::to_vec(&self.meta)
            .map_err(|error| bad_snapshot(Path::new(""), FormatError::Header(error)))?;
        let mut sections = vec![meta.as_slice(), &self.model, &self.optimizer];
        sections.extend(self.weights.as_deref());
        Ok(memsave_common::snapshot::encode_sections(FORMAT, &sections))
    }

    /// Parses a file's bytes; `path` names the file in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |error: FormatError| bad_snapshot(path, error);
        let sections = memsave_common::snapshot::decode_sections(
            bytes,
            FORMAT,
            &["header section", "model section", "optimizer section"],
        )
        .map_err(bad)?;
        // The weights' section, where the weights were in 16 bits.
        let meta: SnapshotMeta =
            serde_json::from_slice(sections[0]).map_err(|error| bad(FormatError::Header(error)))?;
        let weights = match sections.get(3..).unwrap_or_default() {
            [] => None,
            [weights] => Some(weights.to_vec()),
            more => return Err(bad(FormatError::Extra(more.len() - 1))),
        };
        Ok(Snapshot {
            meta,
            model: sections[1].to_vec(),
            optimizer: sections[2].to_vec(),
            weights,
        })
    }

    /// Writes the snapshot to `path` atomically (temporary file, sync, rename).
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
        write_atomically(path, &bytes)
    }

    /// Reads and checks the snapshot at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes, path)
    }
}

/// `model` with the weights of the snapshot at `path`, on any backend (a model trained with
/// autodiff, loaded for inference): the parameter shapes must be the snapshot's.
pub fn load_weights<B, M>(model: M, path: &Path, device: &B::Device) -> Result<M>
where
    B: burn::prelude::Backend,
    M: burn::module::Module<B>,
{
    use burn::module::{ModuleVisitor, Param};
    use burn::prelude::Tensor;
    struct Shapes(Vec<Vec<usize>>);
    impl<B: burn::prelude::Backend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.lazy_shape().dims::<D>().to_vec());
        }
    }
    let snapshot = Snapshot::load(path)?;
    let mut shapes = Shapes(Vec::new());
    model.visit(&mut shapes);
    if snapshot.meta.param_shapes != shapes.0 {
        return Err(Error::snapshot(
            path,
            format!(
                "it was saved from another model ({} parameters there, {} here, or other shapes)",
                snapshot.meta.param_shapes.len(),
                shapes.0.len()
            ),
        ));
    }
    let record = codec::load_bytes::<B, M::Record>(&snapshot.model, device)
        .map_err(|error| bad_snapshot(path, error))?;
    Ok(model.load_record(record))
}

/// Makes `link` name the same snapshot as `target`: a hard link (no second copy on disk) put in
/// place by a rename, so that readers see the old `link` or the new one; where the file system
/// has no hard links, a copy written atomically.
pub fn link_or_copy(target: &Path, link: &Path, snapshot: &Snapshot) -> Result<()> {
    let temporary = temporary_path(link);
    let _ = std::fs::remove_file(&temporary);
    if std::fs::hard_link(target, &temporary).is_ok() {
        return std::fs::rename(&temporary, link).map_err(|source| Error::Io {
            path: link.to_path_buf(),
            source,
        });
    }
    snapshot.save(link)
}
