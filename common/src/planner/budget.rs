//! What a config says about checkpointing: `with_cp = true | false | "auto" |
//! ["backbone.layer1.0", ...]`, and the budget type `[memory] memory_budget = "3GiB" | "60%"`
//! is read into (the section itself: [`crate::config::MemorySection`]).

use serde::Deserialize;

use crate::{Error, Result};

/// Where a model's own settings are in its config (its registry entry says): the runtime names
/// no model key of its own, and speaks these in advice and errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelKeys {
    /// Its checkpointing switch (`model.backbone.with_cp` for a ResNet's blocks).
    pub with_cp: &'static str,
    /// Samples per micro-batch (`data.samples_per_gpu`).
    pub batch: &'static str,
    /// The model's other checkpointing switches (a detector's `model.neck.with_cp` and
    /// `model.bbox_head.with_cp`). A plan names their segments by path in `with_cp`, so wherever
    /// the planner sets `with_cp` it sets these off.
    pub also_with_cp: &'static [&'static str],
}

/// A memory budget: bytes, or a share of the unplanned peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// This many bytes.
    Bytes(u64),
    /// This share (0 < x <= 1) of the peak of the step without any checkpointing.
    Fraction(f64),
}

impl Budget {
    /// `"3GiB"`, `"512 MiB"`, `"2.5GB"`, `"1000000"` or `"60%"`; `field` names it in errors.
    pub fn parse(text: &str, field: &str) -> Result<Budget> {
        let bad = || {
            Error::invalid(
                field,
                format!(
                    "`{text}` is not a memory budget: give bytes (\"3GiB\", \"512MiB\", \"2.5GB\", \
                     3000000000) or a share of the unplanned peak (\"60%\")"
                ),
            )
        };
        let trimmed = text.trim();
        if let Some(number) = trimmed.strip_suffix('%') {
            let percent: f64 = number.trim().parse().map_err(|_| bad())?;
            if !(percent > 0.0 && percent <= 100.0) {
                return Err(Error::invalid(
                    field,
                    format!("`{text}`: a share of the unplanned peak is above 0% and at most 100%"),
                ));
            }
            return Ok(Budget::Fraction(percent / 100.0));
        }
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let value: f64 = number.parse().map_err(|_| bad())?;
        let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "m" | "mb" => 1e6,
            "g" | "gb" => 1e9,
            "t" | "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(bad()),
        };
        let bytes = value * scale;
        if !(bytes >= 1.0 && bytes.is_finite()) {
            return Err(Error::invalid(
                field,
                format!("`{text}`: a memory budget is at least one byte"),
            ));
        }
        // Never clamped: a budget past the largest byte count is a typo, not a wish.
        if bytes >= u64::MAX as f64 {
            return Err(Error::invalid(
                field,
                format!("`{text}`: more bytes than a byte count can hold (2^64)"),
            ));
        }
        Ok(Budget::Bytes(bytes.round() as u64))
    }

    /// The budget in bytes, given the unplanned peak.
    pub fn bytes(self, unplanned_peak: u64) -> u64 {
        match self {
            Budget::Bytes(bytes) => bytes,
            Budget::Fraction(share) => (unplanned_peak as f64 * share).floor() as u64,
        }
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Bytes(bytes) => write!(f, "{}", crate::human_bytes(*bytes)),
            Budget::Fraction(share) => write!(f, "{}% of the unplanned peak", share * 100.0),
        }
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        let raw = Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "a memory budget is bytes (\"3GiB\", 3000000000) or a share (\"60%\")",
            )
        })?;
        match raw {
            Raw::Bytes(bytes) if bytes > 0 => Ok(Budget::Bytes(bytes)),
            Raw::Bytes(_) => Err(serde::de::Error::custom(
                "a memory budget is at least one byte",
            )),
            Raw::Text(text) => Budget::parse(&text, "memory_budget")
                .map_err(|error| serde::de::Error::custom(error_message(&error))),
        }
    }
}

fn error_message(error: &Error) -> String {
    match error {
        Error::InvalidValue { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

/// Which segments are checkpointed (MMCV's `with_cp`, and more).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum WithCp {
    /// None.
    #[default]
    Off,
    /// Every one (MMCV's `with_cp=True`).
    On,
    /// Those the planner picks for `[memory] memory_budget`.
    Auto,
    /// Chosen per step and per segment as each step runs, at its input's size, so that the
    /// step keeps `[memory] memory_budget` (each runtime's `DynamicHook` or `Dynamic`).
    Dynamic,
    /// Exactly these, by module path (a plan pinned by hand, as `memsave plan` prints it).
    Paths(Vec<String>),
}

impl WithCp {
    /// Whether segments are chosen against `[memory] memory_budget` (`"auto"`, `"dynamic"`).
    pub fn is_budgeted(&self) -> bool {
        matches!(self, WithCp::Auto | WithCp::Dynamic)
    }

    /// Whether the model starts with every segment checkpointed (`true`, and `"auto"` and
    /// `"dynamic"`, whose first step is the planner's profile).
    pub fn starts_on(&self) -> bool {
        matches!(self, WithCp::On | WithCp::Auto | WithCp::Dynamic)
    }
}

impl serde::Serialize for WithCp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            WithCp::Off => s.serialize_bool(false),
            WithCp::On => s.serialize_bool(true),
            WithCp::Auto => s.serialize_str("auto"),
            WithCp::Dynamic => s.serialize_str("dynamic"),
            WithCp::Paths(paths) => paths.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for WithCp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Flag(bool),
            Text(String),
            Paths(Vec<String>),
        }
        let wanted = "`with_cp` is true, false, \"auto\" (the planner picks the segments for \
                      `[memory] memory_budget`), \"dynamic\" (chosen per step and segment as \
                      each step runs, within `[memory] memory_budget`) or a list of module paths \
                      ([\"backbone.layer1.0\"])";
        match Raw::deserialize(d).map_err(|_| serde::de::Error::custom(wanted))? {
            Raw::Flag(true) => Ok(WithCp::On),
            Raw::Flag(false) => Ok(WithCp::Off),
            Raw::Text(text) if text == "auto" => Ok(WithCp::Auto),
            Raw::Text(text) if text == "dynamic" => Ok(WithCp::Dynamic),
            Raw::Text(text) => Err(serde::de::Error::custom(format!("`{text}`: {wanted}"))),
            Raw::Paths(paths) => Ok(WithCp::Paths(paths)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse() {
        assert_eq!(Budget::parse("3GiB", "b").unwrap(), Budget::Bytes(3 << 30));
        assert_eq!(
            Budget::parse("512 MiB", "b").unwrap(),
            Budget::Bytes(512 << 20)
        );
        assert_eq!(
            Budget::parse("2.5GB", "b").unwrap(),
            Budget::Bytes(2_500_000_000)
        );
        assert_eq!(Budget::parse("60%", "b").unwrap(), Budget::Fraction(0.6));
        assert_eq!(Budget::Fraction(0.5).bytes(1000), 500);
        let huge = Budget::parse("20000000TiB", "--budget")
            .unwrap_err()
            .to_string();
        assert!(huge.contains("--budget") && huge.contains("2^64"), "{huge}");
        assert_eq!(
            Budget::parse("16000000TiB", "b").unwrap(),
            Budget::Bytes(16_000_000 << 40),
            "below 2^64 bytes is read exactly"
        );
        for bad in ["abc", "", "0", "3 parsecs", "150%", "-1GiB", "0%"] {
            let error = Budget::parse(bad, "memory.memory_budget").unwrap_err();
            assert!(
                error.to_string().contains("memory.memory_budget"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn with_cp_reads_every_form() {
        #[derive(Deserialize)]
        struct S {
            with_cp: WithCp,
        }
        let read = |text: &str| toml::from_str::<S>(text).map(|s| s.with_cp);
        assert_eq!(read("with_cp = true").unwrap(), WithCp::On);
        assert_eq!(read("with_cp = false").unwrap(), WithCp::Off);
        assert_eq!(read("with_cp = \"auto\"").unwrap(), WithCp::Auto);
        assert_eq!(
            read("with_cp = [\"layer1.0\"]").unwrap(),
            WithCp::Paths(vec!["layer1.0".into()])
        );
        let error = read("with_cp = \"sometimes\"").unwrap_err().to_string();
        assert!(error.contains("\"auto\""), "{error}");
    }
}
