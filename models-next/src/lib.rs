//! memsave's models on Burn 0.22.1, ported from `memsave-models` slice by slice
//! (`docs/src/port-0.22.md`): the ResNet, the image classifier and its synthetic data,
//! RetinaNet, Pascal VOC's data and evaluation, torchvision's weights and the registry
//! the commands build runs through so far. They are written the way a Burn 0.22 user
//! writes a model (no backend parameter), with memsave's lean layers
//! (`memsave_next::nn`) and every block a `#[with_cp]` segment.

pub mod classifier;
pub mod config;
pub mod data;
pub mod detection;
pub mod eval;
pub mod registry;
pub mod resnet;
pub mod weights;

/// memsave's runtime under the name the model code ported from `memsave-models` uses.
mod memsave {
    pub use memsave_next::*;
}
