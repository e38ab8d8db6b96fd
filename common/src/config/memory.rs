//! `[memory]`: what a step must fit in, and the host memory CPU staging may use.

use serde::Deserialize;

use crate::planner::Budget;
use crate::{Error, Result};

/// `[memory]`: what a step must fit in.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    /// The most a step may take (`"3GiB"`, or `"60%"` of the step without checkpointing):
    /// with `with_cp = "auto"`, the planner checkpoints what this needs.
    #[serde(default)]
    pub memory_budget: Option<Budget>,
    /// Whether the planner may choose strategies that change the arithmetic beyond rounding
    /// (8-bit optimizer state); off unless set.
    #[serde(default)]
    pub allow_approximate: bool,
    /// The host memory CPU staging may use (`memsave plan` on a device): bytes (`"16GiB"`), or
    /// a share (`"50%"`) of the memory the machine has available when it plans; absent: 50%.
    #[serde(default)]
    pub host_budget: Option<Budget>,
    /// The link between the device and host memory, bytes a second (`"12GiB/s"`), for the time
    /// the planner gives offload's copies; absent: measured on the device before profiling.
    #[serde(default)]
    pub link_bandwidth: Option<Bandwidth>,
}

/// The host budget when `[memory] host_budget` is not set: half the available memory.
pub const DEFAULT_HOST_SHARE: f64 = 0.5;

impl MemorySection {
    /// The host bytes staging may use ([`MemorySection::host_budget_bytes`] of the memory the
    /// machine has available now); `None` where no budget is given and the available memory
    /// cannot be read (staging is then unbounded).
    pub fn host_budget(&self) -> Result<Option<u64>> {
        let available = available_host_memory();
        if self.host_budget.is_none() && available.is_none() {
            return Ok(None);
        }
        self.host_budget_bytes(available).map(Some)
    }

    /// The host bytes staging may use, `available` being the machine's available memory
    /// (`None`: unknown, where only a budget in bytes can be used).
    pub fn host_budget_bytes(&self, available: Option<u64>) -> Result<u64> {
        match (self.host_budget, available) {
            (Some(Budget::Bytes(bytes)), _) => Ok(bytes),
            (Some(budget), Some(available)) => Ok(budget.bytes(available)),
            (None, Some(available)) => Ok(Budget::Fraction(DEFAULT_HOST_SHARE).bytes(available)),
            (_, None) => Err(Error::invalid(
                "memory.host_budget",
                "the machine's available memory could not be read (/proc/meminfo), so a share \
                 of it cannot be taken: give the host bytes staging may use (\"16GiB\")",
            )),
        }
    }
}

/// The machine's available memory (Linux's `MemAvailable`), if it can be read.
pub fn available_host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes a second: `"12GiB/s"`, `"12GiB"` or a number.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bandwidth(pub f64);

impl<'de> Deserialize<'de> for Bandwidth {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
        }
        let wanted = "a bandwidth is bytes a second: \"12GiB/s\", \"800MB/s\" or a number";
        let bytes = match Raw::deserialize(d).map_err(|_| serde::de::Error::custom(wanted))? {
            Raw::Number(bytes) => bytes,
            Raw::Text(text) => {
                let size = text.trim().trim_end_matches("/s");
                match Budget::parse(size, "link_bandwidth") {
                    Ok(Budget::Bytes(bytes)) => bytes as f64,
                    _ => return Err(serde::de::Error::custom(format!("`{text}`: {wanted}"))),
                }
            }
        };
        if !(bytes >= 1.0 && bytes.is_finite()) {
            return Err(serde::de::Error::custom(format!("{bytes}: {wanted}")));
        }
        Ok(Bandwidth(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_budget_and_the_link_read_their_forms() {
        let read = |text: &str| toml::from_str::<MemorySection>(text);
        let memory = read("host_budget = \"2GiB\"\nlink_bandwidth = \"12GiB/s\"").unwrap();
        assert_eq!(memory.host_budget_bytes(None).unwrap(), 2 << 30);
        assert_eq!(
            memory.link_bandwidth,
            Some(Bandwidth(12.0 * (1u64 << 30) as f64))
        );
        let share = read("host_budget = \"25%\"\nlink_bandwidth = 1000").unwrap();
        assert_eq!(share.host_budget_bytes(Some(4000)).unwrap(), 1000);
        assert_eq!(share.link_bandwidth, Some(Bandwidth(1000.0)));
        assert_eq!(
            read("").unwrap().host_budget_bytes(Some(4000)).unwrap(),
            2000,
            "half the available memory by default"
        );
        let unknown = share.host_budget_bytes(None).unwrap_err().to_string();
        assert!(unknown.contains("memory.host_budget"), "{unknown}");
        for bad in [
            "link_bandwidth = \"fast\"",
            "link_bandwidth = 0",
            "link_bandwidth = \"50%\"",
        ] {
            let error = read(bad).unwrap_err().to_string();
            assert!(error.contains("bytes a second"), "{bad}: {error}");
        }
    }
}
