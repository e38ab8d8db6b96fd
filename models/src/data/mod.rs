//! Training data.

mod synthetic;

pub use synthetic::{SyntheticClassification, SyntheticClassificationConfig};
