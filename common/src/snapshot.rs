//! memsave's snapshot format, as far as it names nothing of Burn's: the magic bytes, the format
//! version, and what can be wrong with a file (each runtime reads and writes the records inside
//! with its own Burn).

use crate::error::Error;

/// The first bytes of every snapshot.
pub const MAGIC: &[u8; 8] = b"MEMSAVE\0";
/// The version of the format memsave writes and reads.
pub const FORMAT: u32 = 1;

/// What is wrong with a file in memsave's snapshot format.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// It does not start with memsave's magic bytes.
    #[error("not a memsave checkpoint (wrong magic bytes)")]
    NotASnapshot,
    /// Its checksum does not match its bytes.
    #[error(
        "corrupt or truncated (checksum mismatch: {stored:#010x} stored, {computed:#010x} \
         computed); resume from an earlier checkpoint"
    )]
    Checksum {
        /// The checksum the file holds.
        stored: u32,
        /// The checksum of its bytes.
        computed: u32,
    },
    /// Another version of the format.
    #[error("format version {found}, this memsave reads version {FORMAT}")]
    Version {
        /// The file's version.
        found: u32,
    },
    /// It ends before a section it announces: which.
    #[error("truncated {0}")]
    Truncated(&'static str),
    /// Its JSON header cannot be read or written.
    #[error("unreadable header: {0}")]
    Header(#[source] serde_json::Error),
}

/// The typed cause of an [`Error::Snapshot`].
#[derive(Debug, thiserror::Error)]
pub enum SnapshotCause {
    /// The file's format.
    #[error("{0}")]
    Format(#[from] FormatError),
    /// A record's bytes inside it (the model's, the optimizer's), as the runtime's record codec
    /// read them (downcast to its `CodecError`).
    #[error("{0}")]
    Codec(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// What it holds, read by another reader: a hook's state, a store of weights.
    #[error("{0}")]
    Other(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl From<Error> for SnapshotCause {
    fn from(error: Error) -> Self {
        SnapshotCause::Other(Box::new(error))
    }
}
