//! memsave's lean layers on Burn 0.22 (the port's slice 5c, begun): [`BatchNorm`],
//! [`GroupNorm`] and [`LayerNorm`] as one autodiff operation each, keeping only their input and
//! two fp32 numbers per group for backward, with a fused ReLU (`forward_relu`) whose mask is
//! recomputed in backward; [`relu`], which keeps its output. They stay fp32 inside a
//! half-precision model (statistics, parameters and arithmetic), reading a half input as it is.
//!
//! Burn 0.22's own `BatchNorm` is one operation already (`batch_norm_train`, keeping its input
//! and the statistics), so memsave's brings its fused ReLU, PyTorch's running variance and fp32
//! statistics of a half input; Burn's `LayerNorm` and `GroupNorm` keep an activation-sized
//! tensor beside their input (see [`ops`]'s table, measured). [`BatchNorm::forward_relu_conv`]
//! runs the BatchNorm, its ReLU and the convolution after them as one node that keeps only the
//! input. The convolutions' own weight gradient, pooling and frozen weights come with the rest
//! of the lean layers.

mod batch_norm;
mod fused;
mod layer_norm;
mod math;
pub(crate) mod ops;
mod view;

pub use batch_norm::{BatchNorm, BatchNormConfig};
pub use layer_norm::{GroupNorm, GroupNormConfig, LayerNorm, LayerNormConfig};
pub use ops::relu;
