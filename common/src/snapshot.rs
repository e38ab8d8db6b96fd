//! memsave's snapshot format, as far as it names nothing of Burn's: the container (magic bytes,
//! format version, length-prefixed sections, checksum), its atomic write, and what can be wrong
//! with a file. Each runtime fills the sections with its own Burn's records.
//!
//! Layout: the magic `MEMSAVE\0`, a format version (u32), then length-prefixed (u64) sections,
//! the first always a JSON header with a `memsave_version` field, then a CRC32 of everything
//! before it. Little-endian. The version says which Burn wrote the records inside:
//! [`FORMAT_BURN_0_21`] (Burn's binary record format) or [`FORMAT_BURN_0_22`] (burnpack). Neither
//! Burn reads the other's records, so a file of the other version is refused by name, never
//! misread.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::Error;

/// The first bytes of every snapshot.
pub const MAGIC: &[u8; 8] = b"MEMSAVE\0";
/// The format memsave on Burn 0.21 writes: its records in Burn 0.21's binary record format.
pub const FORMAT_BURN_0_21: u32 = 1;
/// The format memsave on Burn 0.22 writes: its records in burnpack, Burn 0.22's format.
pub const FORMAT_BURN_0_22: u32 = 2;

/// The Burn whose records a format holds, where the format is one memsave wrote.
pub fn burn_of_format(format: u32) -> Option<&'static str> {
    match format {
        FORMAT_BURN_0_21 => Some("0.21"),
        FORMAT_BURN_0_22 => Some("0.22"),
        _ => None,
    }
}

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
    /// Another version of the format: another Burn's records, or a newer memsave's.
    #[error("{}", version_message(*found, *reads, written_by.as_deref()))]
    Version {
        /// The file's version.
        found: u32,
        /// The version this memsave reads.
        reads: u32,
        /// The memsave version that wrote it, where its header says.
        written_by: Option<String>,
    },
    /// It ends before a section it announces: which.
    #[error("truncated {0}")]
    Truncated(&'static str),
    /// It holds more sections than its format has: how many more.
    #[error("{0} section(s) more than its format holds")]
    Extra(usize),
    /// Its JSON header cannot be read or written.
    #[error("unreadable header: {0}")]
    Header(#[source] serde_json::Error),
}

fn version_message(found: u32, reads: u32, written_by: Option<&str>) -> String {
    let by = written_by.map_or(String::new(), |v| format!(" by memsave {v}"));
    let here = burn_of_format(reads).unwrap_or("?");
    match burn_of_format(found) {
        Some(there) => format!(
            "written{by} on Burn {there} (snapshot format {found}); this memsave runs on Burn \
             {here} and reads format {reads}, and Burn {here} cannot read Burn {there}'s \
             records: resume this run with the memsave on Burn {there} that wrote it, or start \
             it again"
        ),
        None => format!(
            "snapshot format {found}{by}, which this memsave (Burn {here}, format {reads}) does \
             not know: it was written by a newer memsave; resume it with that one"
        ),
    }
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

/// The [`Error::Snapshot`] of `path` caused by `cause`: its message is the cause's.
pub fn bad_snapshot(path: &Path, cause: impl Into<SnapshotCause>) -> Error {
    let cause = cause.into();
    Error::Snapshot {
        path: path.to_path_buf(),
        message: cause.to_string(),
        source: Some(cause),
    }
}

/// A snapshot's bytes: `format`, then each section length-prefixed, then the checksum.
pub fn encode_sections(format: u32, sections: &[&[u8]]) -> Vec<u8> {
    let length: usize = sections.iter().map(|s| s.len() + 8).sum();
    let mut out = Vec::with_capacity(MAGIC.len() + 4 + length + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&format.to_le_bytes());
    for section in sections {
        out.extend_from_slice(&(section.len() as u64).to_le_bytes());
        out.extend_from_slice(section);
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The sections of a snapshot's bytes in format `reads`: one for each of `named` (the names
/// the truncation errors give), then any further ones (sections a format has where a run used
/// them: 0.21's weights' store). The checksum is checked first; a file of another format is
/// refused with the memsave version its header names.
pub fn decode_sections<'a>(
    bytes: &'a [u8],
    reads: u32,
    named: &[&'static str],
) -> Result<Vec<&'a [u8]>, FormatError> {
    if bytes.len() < MAGIC.len() + 4 + 4 || &bytes[..MAGIC.len()] != MAGIC {
        return Err(FormatError::NotASnapshot);
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes(crc.try_into().expect("four bytes"));
    let computed = crc32fast::hash(body);
    if computed != stored {
        return Err(FormatError::Checksum { stored, computed });
    }
    let mut rest = &body[MAGIC.len()..];
    let format = u32::from_le_bytes(
        take(&mut rest, 4)
            .ok_or(FormatError::Truncated("before its format version"))?
            .try_into()
            .expect("four bytes"),
    );
    if format != reads {
        // Every format starts with the JSON header: read who wrote it, where it can be read.
        let written_by = section(&mut rest)
            .and_then(|header| serde_json::from_slice::<serde_json::Value>(header).ok())
            .and_then(|header| header.get("memsave_version")?.as_str().map(str::to_owned));
        return Err(FormatError::Version {
            found: format,
            reads,
            written_by,
        });
    }
    let mut sections = Vec::with_capacity(named.len() + 1);
    for name in named {
        if rest.len() < 8 {
            return Err(FormatError::Truncated(name));
        }
        sections.push(section(&mut rest).ok_or(FormatError::Truncated(name))?);
    }
    while !rest.is_empty() {
        sections.push(section(&mut rest).ok_or(FormatError::Truncated("last section"))?);
    }
    Ok(sections)
}

fn section<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let length = u64::from_le_bytes(take(rest, 8)?.try_into().expect("eight bytes"));
    take(rest, usize::try_from(length).ok()?)
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
pub fn write_atomically(path: &Path, bytes: &[u8]) -> crate::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn file(format: u32, version: &str) -> Vec<u8> {
        let header = format!(r#"{{"memsave_version":"{version}","iter":3}}"#);
        encode_sections(format, &[header.as_bytes(), b"model", b"optimizer"])
    }

    #[test]
    fn sections_come_back_as_written() {
        let bytes = file(FORMAT_BURN_0_22, "0.1.0");
        let sections = decode_sections(&bytes, FORMAT_BURN_0_22, &["header", "model"]).unwrap();
        assert_eq!(sections.len(), 3);
        assert_eq!(sections[1], b"model");
        assert_eq!(sections[2], b"optimizer");
    }

    #[test]
    fn the_other_burns_format_is_refused_naming_who_wrote_it() {
        let old = file(FORMAT_BURN_0_21, "0.1.0");
        let error = decode_sections(&old, FORMAT_BURN_0_22, &["header"]).unwrap_err();
        let said = error.to_string();
        assert!(
            matches!(error, FormatError::Version { found: 1, reads: 2, ref written_by }
                if written_by.as_deref() == Some("0.1.0")),
            "{said}"
        );
        for part in [
            "by memsave 0.1.0",
            "on Burn 0.21",
            "runs on Burn 0.22",
            "format 1",
        ] {
            assert!(said.contains(part), "{part:?} in {said}");
        }
        let new = file(FORMAT_BURN_0_22, "0.2.0");
        let said = decode_sections(&new, FORMAT_BURN_0_21, &["header"])
            .unwrap_err()
            .to_string();
        assert!(
            said.contains("on Burn 0.22") && said.contains("0.2.0"),
            "{said}"
        );
        let future = file(7, "9.0.0");
        let said = decode_sections(&future, FORMAT_BURN_0_22, &["header"])
            .unwrap_err()
            .to_string();
        assert!(
            said.contains("newer memsave") && said.contains("9.0.0"),
            "{said}"
        );
    }

    #[test]
    fn damage_is_named_never_a_panic() {
        let bytes = file(FORMAT_BURN_0_22, "0.1.0");
        for cut in 0..bytes.len() {
            assert!(decode_sections(&bytes[..cut], FORMAT_BURN_0_22, &["header"]).is_err());
        }
        let mut flipped = bytes.clone();
        flipped[20] ^= 1;
        assert!(matches!(
            decode_sections(&flipped, FORMAT_BURN_0_22, &["header"]),
            Err(FormatError::Checksum { .. })
        ));
        // A whole file (its checksum right) that announces more than it holds.
        let short = encode_sections(FORMAT_BURN_0_22, &[b"{}"]);
        assert!(matches!(
            decode_sections(&short, FORMAT_BURN_0_22, &["header", "model section"]),
            Err(FormatError::Truncated("model section"))
        ));
        let mut lying = short[..short.len() - 4].to_vec();
        lying[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        let crc = crc32fast::hash(&lying);
        lying.extend_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            decode_sections(&lying, FORMAT_BURN_0_22, &["header"]),
            Err(FormatError::Truncated("header"))
        ));
    }
}
