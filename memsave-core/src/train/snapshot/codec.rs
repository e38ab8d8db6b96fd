//! Records as bytes: the model's (Burn's binary record format, full precision) and the
//! optimizer's, entry by entry in parameter order so that the same state always gives the same
//! bytes. Errors say what is wrong; the caller names the file.

use burn::module::ParamId;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};

/// What is wrong with a record's bytes.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// Burn's recorder could not encode a record.
    #[error("could not encode a record: {0}")]
    Encode(#[source] burn::record::RecorderError),
    /// A record's bytes could not be decoded (damaged, or of another type): bincode's error.
    #[error("could not decode a record: {0}")]
    Decode(#[source] bincode::error::DecodeError),
    /// The per-parameter layout around the records is damaged: what is wrong.
    #[error("{0}")]
    Layout(&'static str),
}

/// A record as bytes (full precision, so that a resumed run continues exactly).
pub fn record_bytes<B: burn::prelude::Backend, R: burn::record::Record<B>>(
    record: R,
) -> Result<Vec<u8>, CodecError> {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .record(record, ())
        .map_err(CodecError::Encode)
}

/// A record from bytes written by [`record_bytes`]. Decoded here as Burn's recorder decodes
/// them (bincode's standard configuration, Burn's record envelope): Burn 0.21's
/// `BinBytesRecorder::load` unwraps bincode's error, which would make a damaged snapshot a
/// panic; here it is the [`CodecError::Decode`] it is.
pub fn load_bytes<B: burn::prelude::Backend, R: burn::record::Record<B>>(
    bytes: &[u8],
    device: &B::Device,
) -> Result<R, CodecError> {
    let (record, _): (
        burn::record::BurnRecord<R::Item<FullPrecisionSettings>, B>,
        usize,
    ) = bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map_err(CodecError::Decode)?;
    Ok(R::from_item(record.item, device))
}

/// A per-parameter record as bytes, entries sorted by parameter id: a count (u64), then per
/// entry the id and the record, each length-prefixed (u64, little-endian).
pub fn encode_by_param<B: burn::prelude::Backend, R: burn::record::Record<B>>(
    record: impl IntoIterator<Item = (ParamId, R)>,
) -> Result<Vec<u8>, CodecError> {
    let mut entries: Vec<(ParamId, R)> = record.into_iter().collect();
    entries.sort_by_key(|(id, _)| id.val());
    let mut out = (entries.len() as u64).to_le_bytes().to_vec();
    for (id, record) in entries {
        for part in [id.serialize().into_bytes(), record_bytes::<B, _>(record)?] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(&part);
        }
    }
    Ok(out)
}

/// One state as [`encode_by_param`] writes it, from several (each peer's part of a sharded
/// optimizer state): every entry of every part, sorted by parameter id, the records copied as
/// they are (not decoded).
pub fn merge_by_param(parts: &[Vec<u8>]) -> Result<Vec<u8>, CodecError> {
    let truncated = || CodecError::Layout("a part of the optimizer state is truncated");
    let take = |bytes: &mut &[u8], length: usize| -> Result<Vec<u8>, CodecError> {
        let (field, rest) = bytes.split_at_checked(length).ok_or_else(truncated)?;
        *bytes = rest;
        Ok(field.to_vec())
    };
    let length = |bytes: &mut &[u8]| -> Result<usize, CodecError> {
        let field = take(bytes, 8)?;
        Ok(u64::from_le_bytes(field.try_into().expect("eight bytes")) as usize)
    };
    let mut entries: Vec<(u64, Vec<u8>, Vec<u8>)> = Vec::new();
    for part in parts {
        let mut bytes = part.as_slice();
        let count = length(&mut bytes)?;
        for _ in 0..count {
            let id_length = length(&mut bytes)?;
            let id = take(&mut bytes, id_length)?;
            let record_length = length(&mut bytes)?;
            let record = take(&mut bytes, record_length)?;
            let value = String::from_utf8(id.clone())
                .ok()
                .and_then(|id| ParamId::try_deserialize(&id))
                .ok_or_else(|| {
                    CodecError::Layout("a parameter id in the optimizer state is unreadable")
                })?
                .val();
            entries.push((value, id, record));
        }
    }
    entries.sort_by_key(|(value, _, _)| *value);
    let mut out = (entries.len() as u64).to_le_bytes().to_vec();
    for (_, id, record) in entries {
        for field in [id, record] {
            out.extend_from_slice(&(field.len() as u64).to_le_bytes());
            out.extend_from_slice(&field);
        }
    }
    Ok(out)
}

/// The state written by [`encode_by_param`] with each entry's parameter id replaced by
/// `rename(id)` (entries it maps to `None` are dropped), re-sorted; the records are copied as
/// they are. Peers of a data-parallel run give their parameters different ids: a state gathered
/// from several is keyed by the parameters' positions on the way, and by rank 0's ids at the end.
pub fn rename_by_param(
    bytes: &[u8],
    rename: impl Fn(ParamId) -> Option<ParamId>,
) -> Result<Vec<u8>, CodecError> {
    let merged = merge_by_param(&[bytes.to_vec()])?;
    let mut parts = Vec::new();
    let mut rest = &merged[8..];
    let field = |rest: &mut &[u8]| -> Vec<u8> {
        let length = u64::from_le_bytes(rest[..8].try_into().expect("eight bytes")) as usize;
        let value = rest[8..8 + length].to_vec();
        *rest = &rest[8 + length..];
        value
    };
    while !rest.is_empty() {
        let id = field(&mut rest);
        let record = field(&mut rest);
        let id = String::from_utf8(id)
            .ok()
            .and_then(|id| ParamId::try_deserialize(&id))
            .ok_or_else(|| {
                CodecError::Layout("a parameter id in the optimizer state is unreadable")
            })?;
        if let Some(id) = rename(id) {
            parts.push((id, record));
        }
    }
    let mut out = (parts.len() as u64).to_le_bytes().to_vec();
    for (id, record) in parts {
        for field in [id.serialize().into_bytes(), record] {
            out.extend_from_slice(&(field.len() as u64).to_le_bytes());
            out.extend_from_slice(&field);
        }
    }
    // Sorted by the new ids.
    merge_by_param(&[out])
}

/// The entries written by [`encode_by_param`].
pub fn decode_by_param<B, R, Map>(mut bytes: &[u8], device: &B::Device) -> Result<Map, CodecError>
where
    B: burn::prelude::Backend,
    R: burn::record::Record<B>,
    Map: FromIterator<(ParamId, R)>,
{
    let truncated = || CodecError::Layout("the optimizer state is truncated");
    let next = |bytes: &mut &[u8]| -> Result<Vec<u8>, CodecError> {
        let (length, rest) = bytes.split_at_checked(8).ok_or_else(truncated)?;
        let length = u64::from_le_bytes(length.try_into().expect("eight bytes")) as usize;
        let (part, rest) = rest.split_at_checked(length).ok_or_else(truncated)?;
        *bytes = rest;
        Ok(part.to_vec())
    };
    let (count, rest) = bytes.split_at_checked(8).ok_or_else(truncated)?;
    let count = u64::from_le_bytes(count.try_into().expect("eight bytes"));
    bytes = rest;
    let mut record = Vec::new();
    for _ in 0..count {
        let id = String::from_utf8(next(&mut bytes)?)
            .ok()
            .and_then(|id| ParamId::try_deserialize(&id))
            .ok_or_else(|| {
                CodecError::Layout("a parameter id in the optimizer state is unreadable")
            })?;
        record.push((id, load_bytes::<B, R>(&next(&mut bytes)?, device)?));
    }
    Ok(record.into_iter().collect())
}
