//! Training data: a synthetic classification set, and Pascal VOC for detection.

mod synthetic;
pub mod voc;

pub use synthetic::{SyntheticClassification, SyntheticClassificationConfig};
