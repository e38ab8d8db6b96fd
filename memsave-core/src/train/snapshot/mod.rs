//! Snapshots of a run on disk (MMCV's checkpoint files: `checkpoint_config`, `--resume`): the
//! model, the optimizer state, every hook's state (the loss scaler, the accumulation position)
//! and the position in the run. ("Checkpoint" in memsave's code means recomputation, as in
//! `torch.utils.checkpoint`.)
//!
//! Layout: the magic `MEMSAVE\0`, a format version (u32), then three length-prefixed (u64)
//! sections: a JSON header, the model record, the optimizer record; with 16-bit weights a
//! fourth, the weights' store (the step count, Kahan's compensations); then a CRC32 of
//! everything before it. Little-endian. A file is written to a temporary sibling, synced, then renamed over
//! the target, so a crash leaves the previous snapshot whole; a truncated or corrupted file is
//! an error that names it, never a panic.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub mod codec;

pub use memsave_common::snapshot::{FormatError, SnapshotCause, FORMAT, MAGIC};

impl From<codec::CodecError> for SnapshotCause {
    fn from(error: codec::CodecError) -> Self {
        SnapshotCause::Codec(Box::new(error))
    }
}

/// The [`Error::Snapshot`] of `path` caused by `cause`: its message is the cause's.
pub(crate) fn bad_snapshot(path: &Path, cause: impl Into<SnapshotCause>) -> Error {
    let cause = cause.into();
    Error::Snapshot {
        path: path.to_path_buf(),
        message: cause.to_string(),
        source: Some(cause),
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
        let mut out = Vec::with_capacity(32 + meta.len() + self.model.len() + self.optimizer.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT.to_le_bytes());
        let sections = [&meta, &self.model, &self.optimizer];
        for section in sections.into_iter().chain(self.weights.as_ref()) {
            out.extend_from_slice(&(section.len() as u64).to_le_bytes());
            out.extend_from_slice(section);
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(out)
    }

    /// Parses a file's bytes; `path` names the file in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |error: FormatError| bad_snapshot(path, error);
        if bytes.len() < MAGIC.len() + 4 + 4 || &bytes[..MAGIC.len()] != MAGIC {
            return Err(bad(FormatError::NotASnapshot));
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().expect("four bytes"));
        let computed = crc32fast::hash(body);
        if computed != stored {
            return Err(bad(FormatError::Checksum { stored, computed }));
        }
        let mut rest = &body[MAGIC.len()..];
        let format = u32::from_le_bytes(
            take(&mut rest, 4)
                .ok_or_else(|| bad(FormatError::Truncated("before its format version")))?
                .try_into()
                .expect("four bytes"),
        );
        if format != FORMAT {
            return Err(bad(FormatError::Version { found: format }));
        }
        let mut sections = Vec::with_capacity(3);
        for (before, section) in [
            ("before the header section", "header section"),
            ("before the model section", "model section"),
            ("before the optimizer section", "optimizer section"),
        ] {
            let length = take(&mut rest, 8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")) as usize)
                .ok_or_else(|| bad(FormatError::Truncated(before)))?;
            let bytes =
                take(&mut rest, length).ok_or_else(|| bad(FormatError::Truncated(section)))?;
            sections.push(bytes);
        }
        // The weights' section, where the header says the weights were in 16 bits.
        let meta: SnapshotMeta =
            serde_json::from_slice(sections[0]).map_err(|error| bad(FormatError::Header(error)))?;
        let weights = if rest.is_empty() {
            None
        } else {
            let length = take(&mut rest, 8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")) as usize)
                .ok_or_else(|| bad(FormatError::Truncated("before the weights' section")))?;
            let bytes = take(&mut rest, length)
                .ok_or_else(|| bad(FormatError::Truncated("weights' section")))?;
            Some(bytes.to_vec())
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

fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if rest.len() < n {
        return None;
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Some(head)
}

/// The temporary sibling a write goes through.
pub fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Writes `bytes` to `path` so that readers see either the old file or the whole new one.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let temporary = temporary_path(path);
    let written = (|| {
        let mut file = File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()
    })();
    if let Err(source) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(Error::Io {
            path: temporary,
            source,
        });
    }
    std::fs::rename(&temporary, path).map_err(io)?;
    // Make the rename itself durable where the platform allows it.
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        if let Ok(directory) = File::open(parent) {
            let _ = directory.sync_all();
        }
    }
    Ok(())
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
