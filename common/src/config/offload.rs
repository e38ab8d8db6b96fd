//! `[offload]`: what goes to host memory (CPU staging), read into the runtime's
//! [`ActivationOffload`] and the optimizer hook's offload switch.
//!
//! ```toml
//! [offload]
//! optimizer = true          # optimizer state and fp32 masters in host memory, stepped there
//! activations = true        # checkpointed segments' kept inputs wait in host memory
//! min_bytes = "1KiB"        # smaller tensors stay on the device
//! max_in_flight = "256MiB"  # device bytes whose copy to the host may be under way at once
//! prefetch = 2              # segments brought back ahead of the recomputation
//! ```

use serde::Deserialize;

use crate::offload::ActivationOffload;
use crate::planner::Budget;

/// `[offload]`: what goes to host memory (see the module docs). Unset values take
/// [`ActivationOffload::default`]'s.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadSection {
    /// The inputs that checkpointed segments keep for their recomputation, to host memory
    /// during the forward and back before the recomputation (checkpointing must be on).
    #[serde(default)]
    pub activations: bool,
    /// The optimizer's state and the fp32 master weights in host memory, each parameter stepped
    /// there as its gradient is final (the optimizer hook's `with_optimizer_offload`).
    #[serde(default)]
    pub optimizer: bool,
    /// Tensors smaller than this stay on the device (bytes, or `"1KiB"`).
    #[serde(default)]
    pub min_bytes: Option<Bytes>,
    /// The most device bytes whose copy to the host may be under way at once.
    #[serde(default)]
    pub max_in_flight: Option<Bytes>,
    /// How many segments backward brings back ahead of the one it recomputes.
    #[serde(default)]
    pub prefetch: Option<usize>,
}

impl OffloadSection {
    /// The activation offload asked for, if any.
    pub fn activations(&self) -> Option<ActivationOffload> {
        let default = ActivationOffload::default();
        self.activations.then(|| ActivationOffload {
            min_bytes: self.min_bytes.map_or(default.min_bytes, |b| b.0),
            max_in_flight: self.max_in_flight.map_or(default.max_in_flight, |b| b.0),
            prefetch: self.prefetch.unwrap_or(default.prefetch),
        })
    }
}

/// A byte count: a number, or a string with a unit (`"1KiB"`, `"256MiB"`, `"2GB"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        let raw = Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("a size is bytes: a number (1024) or a string (\"1KiB\")")
        })?;
        match raw {
            Raw::Number(bytes) => Ok(Bytes(bytes)),
            Raw::Text(text) => match Budget::parse(&text, "size") {
                Ok(Budget::Bytes(bytes)) => Ok(Bytes(bytes)),
                _ => Err(serde::de::Error::custom(format!(
                    "`{text}` is not a size: give bytes (1024, \"1KiB\", \"256MiB\", \"2GB\")"
                ))),
            },
        }
    }
}
