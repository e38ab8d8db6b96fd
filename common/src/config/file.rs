//! Reading a configuration: MMCV's `_base_` inheritance and `--set key=value` overrides, on
//! TOML tables, before anything is deserialised.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The TOML table of `path`, over the tables of the files its `_base_` names (MMCV's config
/// inheritance: `_base_ = "base.toml"` or a list; paths relative to the file; later bases and
/// the file itself win, table by table). A base that cannot be read is an error that names the
/// file that includes it.
pub(super) fn read_with_bases(path: &Path, chain: &mut Vec<PathBuf>) -> Result<toml::Table> {
    let error = |message: String| Error::Config {
        path: path.to_path_buf(),
        message,
        source: None,
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
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| not_toml(path, e))?;
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
        let base_path = directory.join(&base);
        if !base_path.is_file() {
            return Err(error(format!(
                "`_base_ = \"{base}\"`: {} does not exist or is not a file",
                base_path.display()
            )));
        }
        merge(&mut merged, read_with_bases(&base_path, chain)?);
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

/// One `--set key=value`: the dotted key, and the argument as the user wrote it.
#[derive(Clone, Debug)]
pub(super) struct Override {
    pub key: String,
    pub argument: String,
}

/// The error of a file at `path` that is not TOML: the parser's words with the line, column
/// and text it stopped at, and its error as the cause.
pub(super) fn not_toml(path: &Path, error: toml::de::Error) -> Error {
    Error::Config {
        path: path.to_path_buf(),
        message: error.to_string(),
        source: Some(error),
    }
}

/// `a.b.c=value` into `table`: the value is read as TOML (`4`, `2.5`, `true`, `"text"`,
/// `[1, 2]`, `{ max_norm = 35 }`), or taken as a string when it is not TOML.
pub(super) fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<Override> {
    let error = |message: String| Error::Override {
        argument: assignment.to_string(),
        message,
        source: None,
    };
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| error("expected `key=value`".into()))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(error(format!("`{key}` is not a dotted key")));
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
        current = entry
            .as_table_mut()
            .ok_or_else(|| error(format!("`{}` is not a table", walked.join("."))))?;
    }
    current.insert(last.to_string(), value);
    Ok(Override {
        key: key.to_string(),
        argument: assignment.to_string(),
    })
}
