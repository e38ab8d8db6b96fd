//! Models built with memsave: a ResNet backbone, an image classifier on it, RetinaNet
//! (R50-FPN), their data (a synthetic classification set, Pascal VOC) and VOC's evaluation;
//! [`registry`] is what memsave's commands know of them.

#![warn(missing_docs)]

pub mod classifier;
pub mod config;
pub mod data;
pub mod detection;
pub mod eval;
pub mod registry;
pub mod resnet;
pub mod weights;

/// memsave's runtime and macros under the name model code uses (`memsave::nn`, `#[memsave::model]`),
/// without depending on the facade (which depends on this crate).
mod memsave {
    pub use memsave_core::*;
    pub use memsave_macros::{auto_fp16, force_fp32, model, with_cp};

    pub use memsave_core::checkpoint::CheckpointBackend as Backend;
}
