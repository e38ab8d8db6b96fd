//! Layers that memsave models need beyond `burn::nn`, and the operations under them.
//!
//! [`BatchNorm`], [`GroupNorm`] and [`LayerNorm`] stay in fp32 inside a half-precision model, as
//! MMCV's `wrap_fp16_model` keeps its norms: with the flag on, a half input is read as it is,
//! normalised with fp32 statistics and parameters in fp32 arithmetic, and written back as half.
//! Each is one autodiff operation with a hand-written backward that keeps only its input and
//! two fp32 numbers per group; `forward_relu` fuses the ReLU that usually follows. [`Relu`]
//! keeps its output instead of its input. [`BatchNorm`], [`Dropout`] and [`GaussianNoise`] also
//! behave under gradient checkpointing: statistics updated once per step, masks and noise reused
//! by the recomputation.
//!
//! The lean ops run on every backend whose inner backend implements
//! [`kernels::LeanBackend`] (Flex; every CubeCL runtime: CUDA, wgpu, ROCm), under any autodiff
//! checkpoint strategy; [`is_lean`] tells whether a backend has them. Elsewhere the same
//! arithmetic runs as Burn's composed ops (more memory), and the backend is named once on
//! stderr.

mod batch_norm;
mod conv;
mod dropout;
pub mod frozen;
mod group_norm;
pub mod kernels;
mod layer_norm;
mod noise;
mod ops;
mod pool;
mod relu;

pub use batch_norm::{BatchNorm, BatchNormConfig};
pub use conv::{conv2d, linear};
pub use dropout::{Dropout, DropoutConfig};
pub use frozen::{FrozenDtype, FrozenWeights};
pub use group_norm::{GroupNorm, GroupNormConfig};
pub use layer_norm::{LayerNorm, LayerNormConfig};
pub use noise::{GaussianNoise, GaussianNoiseConfig};
pub(crate) use ops::{dequantize_blocks, quantize_blocks};
pub use ops::{host_resident, is_lean, lean_backends, register_backend};
pub use pool::max_pool2d;
pub use relu::{add, relu, Relu};
