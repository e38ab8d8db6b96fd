//! Training data on Burn 0.22: Pascal VOC (the devkit's files, MMDetection's pipeline, batches
//! made by background threads, a synthetic set in VOC's format) and the synthetic classification
//! set, each readable by data-parallel shards.

pub mod synthetic;
pub mod voc;
