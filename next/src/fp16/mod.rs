//! Mixed precision on Burn 0.22: the `fp16_enabled` flag, [`Fp16Module`] and
//! [`wrap_fp16_model`].
//!
//! MMCV 1.x semantics: a module carries an `fp16_enabled` flag, off by default; its methods
//! marked `#[auto_fp16]` cast their fp32 tensor arguments to half when the flag is on, and those
//! marked `#[force_fp32]` cast half arguments back to fp32. [`wrap_fp16_model`] switches the
//! flag on in the model and every submodule, casts the float parameters to half, and leaves out
//! the layers that are unsafe in half.
//!
//! memsave goes further than MMCV in three ways: the half type is chosen per model
//! ([`Precision::F16`] or [`Precision::Bf16`]); any layer can be kept in fp32 as an *island*
//! ([`Fp32`], `#[fp16(fp32)]` on a field), its inputs cast to fp32 and its outputs cast back;
//! and a layer that is unsafe in half precision is a compile error that says so, not a wrong
//! number at run time. (On Burn 0.22 a tensor's dtype is a run-time value and two dtypes meeting
//! in one op are not checked: Burn's GPU kernels read the second operand as the first's dtype.
//! The compile error is the only check.)
//!
//! | `burn::nn` layers (0.22.1) | under `wrap_fp16_model` |
//! |---|---|
//! | Linear, Embedding, Conv*, ConvTranspose*, PRelu, SwiGlu, Activation, GateController, MultiHeadAttention, CrossAttention, PositionWiseFeedForward (its activation too), RmsNorm, LayerNorm, GroupNorm, InstanceNorm, TransformerEncoder/Decoder and their layers | parameters cast to half (Burn 0.22 computes the f16 statistics of LayerNorm, GroupNorm, InstanceNorm and RmsNorm in fp32 itself) |
//! | PositionalEncoding | its constant table cast to half |
//! | parameter-free activations (Softplus included: Burn 0.22 caps its threshold in f16), Identity, Dropout, RRelu, pools, Interpolate, Fold4d, Unfold4d, PixelShuffle, losses | unchanged (compute in their input's dtype; call losses from `#[force_fp32]` methods, as MMCV does) |
//! | BatchNorm, LocalResponseNorm | not in half (their statistics are computed in the input's dtype, which overflows f16): a compile error pointing to `#[fp16(fp32)]` |
//! | Lstm, Gru, Rnn (and Bi*), RotaryEncoding, GaussianNoise, DeformConv2d, CosineSimilarity, PairwiseDistance | not in half (they make fp32 tensors of their own, which meet half ones, or their epsilon vanishes in f16): a compile error pointing to `#[fp16(fp32)]` |
//!
//! A model with the flag whose field is Burn's `BatchNorm` does not compile (`Fp16Module` is
//! not implemented for it; its message says to keep it fp32 with `#[fp16(fp32)]`):
//!
//! ```compile_fail,E0277
//! use burn::nn::{BatchNorm, Linear};
//! use burn::prelude::*;
//! use memsave_next::fp16::Fp16;
//!
//! #[memsave_macros::model]
//! #[derive(Module, Debug)]
//! struct Net {
//!     conv: Linear,
//!     bn: BatchNorm,
//!     fp16_enabled: Fp16,
//! }
//! ```
//!
//! With the island it does:
//!
//! ```
//! use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
//! use burn::prelude::*;
//! use burn::tensor::DType;
//! use memsave_next::fp16::{wrap_fp16_model, Fp16, Precision};
//!
//! #[memsave_macros::model]
//! #[derive(Module, Debug)]
//! struct Net {
//!     linear: Linear,
//!     #[fp16(fp32)]
//!     bn: BatchNorm,
//!     fp16_enabled: Fp16,
//! }
//!
//! impl Net {
//!     #[memsave_macros::auto_fp16]
//!     fn forward(&self, x: Tensor<3>) -> Tensor<3> {
//!         self.bn.forward(self.linear.forward(x))
//!     }
//! }
//!
//! let device = Device::flex().autodiff();
//! let net = Net {
//!     linear: LinearConfig::new(4, 4).init(&device),
//!     bn: BatchNormConfig::new(2).init(&device).into(),
//!     fp16_enabled: Fp16::Off,
//! };
//! let net = wrap_fp16_model(net, Precision::F16);
//! let out = net.forward(Tensor::ones([3, 2, 4], &device));
//! assert_eq!(out.dtype(), DType::F16);
//! ```
//!
//! `#[auto_fp16]`'s first-layer guard: the method that takes the network's input cannot pass it
//! straight to a checkpointed field (its input does not require grad, so the segment would never
//! be checkpointed):
//!
//! ```compile_fail,E0277
//! use burn::nn::Linear;
//! use burn::prelude::*;
//! use memsave_next::fp16::Fp16;
//!
//! #[memsave_macros::model]
//! #[derive(Module, Debug)]
//! struct Block {
//!     linear: Linear,
//!     with_cp: bool,
//! }
//!
//! impl Block {
//!     #[memsave_macros::with_cp]
//!     fn forward(&self, x: Tensor<2>) -> Tensor<2> {
//!         self.linear.forward(x)
//!     }
//! }
//!
//! #[memsave_macros::model]
//! #[derive(Module, Debug)]
//! struct Net {
//!     #[with_cp]
//!     stem: Block,
//!     fp16_enabled: Fp16,
//! }
//!
//! impl Net {
//!     #[memsave_macros::auto_fp16]
//!     fn forward(&self, images: Tensor<2>) -> Tensor<2> {
//!         self.stem.forward(images)
//!     }
//! }
//! ```

mod impls;
mod island;
mod island_forward;

pub use island::Fp32;
pub use island_forward::{MhaInput, TransformerDecoderInput, TransformerEncoderInput};

use std::fmt;

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param,
};
use burn::tensor::{DType, Device, Tensor};

use crate::cast::{cast_tensor_type, CastFloat};

pub use memsave_common::fp16::Precision;

/// The tensor dtype of a [`Precision`] (memsave-common's type, which names nothing of Burn's).
pub trait PrecisionExt {
    /// The tensor dtype of this precision.
    fn dtype(self) -> DType;
}

impl PrecisionExt for Precision {
    fn dtype(self) -> DType {
        match self {
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }
}

/// The `fp16_enabled` flag of a module: off, or on with the half type to run in.
///
/// A field `fp16_enabled: Fp16` in a `#[memsave::model]` struct makes its `#[auto_fp16]` and
/// `#[force_fp32]` methods work. To Burn it is a constant, like a `bool` field: it is not saved in
/// records and survives `valid()`, `fork()` and `map()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fp16 {
    /// Methods run exactly as written (MMCV's `fp16_enabled = False`).
    #[default]
    Off,
    /// Set by [`wrap_fp16_model`]: `#[auto_fp16]` casts fp32 to this precision.
    On(Precision),
}

impl Fp16 {
    /// The half precision when the flag is on.
    pub fn precision(self) -> Option<Precision> {
        match self {
            Fp16::Off => None,
            Fp16::On(precision) => Some(precision),
        }
    }

    /// Whether the flag is on.
    pub fn is_on(self) -> bool {
        matches!(self, Fp16::On(_))
    }

    /// Flag on: every fp32 float tensor in `value`, and every tensor of the other half type,
    /// cast to the model's half type (so the body sees exactly the type it was promised).
    /// Flag off: `value` unchanged.
    ///
    /// | input | f16 model | bf16 model |
    /// |---|---|---|
    /// | f32 | f16 | bf16 |
    /// | f16 | f16 | bf16 |
    /// | bf16 | f16 | bf16 |
    /// | f64, int, bool | unchanged | unchanged |
    pub fn to_half<T: CastFloat>(self, value: T) -> T {
        match self {
            Fp16::Off => value,
            Fp16::On(precision) => {
                let half = precision.dtype();
                let value = cast_tensor_type(value, DType::F32, half);
                cast_tensor_type(value, precision.other().dtype(), half)
            }
        }
    }

    /// Flag on: every half float tensor in `value`, f16 or bf16 whatever the model's half type,
    /// cast to fp32 (`force_fp32` guarantees fp32). Flag off: `value` unchanged.
    pub fn to_fp32<T: CastFloat>(self, value: T) -> T {
        match self {
            Fp16::Off => value,
            Fp16::On(_) => {
                let value = cast_tensor_type(value, DType::F16, DType::F32);
                cast_tensor_type(value, DType::BF16, DType::F32)
            }
        }
    }
}

impl fmt::Display for Fp16 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fp16::Off => f.write_str("off"),
            Fp16::On(precision) => write!(f, "on ({precision})"),
        }
    }
}

/// A constant to Burn, like a `bool` field: no parameter, no record, kept by `valid()`, `fork()`
/// and `map()`.
impl Module for Fp16 {
    fn collect_devices(&self, devices: Devices) -> Devices {
        devices
    }

    fn fork(self, _device: &Device) -> Self {
        self
    }

    fn to_device(self, _device: &Device) -> Self {
        self
    }

    fn train(self) -> Self {
        self
    }

    fn valid(&self) -> Self {
        *self
    }

    fn materialize(self) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper>(self, _mapper: &mut M) -> Self {
        self
    }
}

impl ModuleDisplayDefault for Fp16 {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_formatted(self).optional()
    }
}

impl ModuleDisplay for Fp16 {}

/// A module that has an `fp16_enabled` flag, read by `#[auto_fp16]` and `#[force_fp32]`.
///
/// `#[memsave::model]` implements it for a struct with a field `fp16_enabled: Fp16`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no fp16 flag, so `#[auto_fp16]` / `#[force_fp32]` cannot be used on its methods",
    label = "this method reads `self.fp16_enabled`",
    note = "put `#[memsave::model]` on the struct and give it a field `fp16_enabled: memsave::fp16::Fp16` \
            (start it at `Fp16::Off`; `wrap_fp16_model` switches it on)"
)]
pub trait HasFp16Flag {
    /// The module's own flag.
    fn fp16_enabled(&self) -> Fp16;
}

/// A module that [`wrap_fp16_model`] can reach: it switches its flag on (if it has one), casts
/// its float parameters to half (unless it is an fp32 island), and recurses into its
/// submodules.
///
/// Implemented by `#[memsave::model]` structs, by the layers of `burn::nn`
/// that run in half precision, by [`Fp32`] islands, by containers of such modules, and (doing
/// nothing) by plain values. Left out on purpose (see the table in the [module docs](self)):
/// Burn's `BatchNorm` and `LocalResponseNorm` (f16 overflows their statistics), and the layers
/// that make fp32 tensors of their own. Keep them fp32 with `#[fp16(fp32)]`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be part of a mixed-precision model: it does not implement `Fp16Module`",
    label = "`wrap_fp16_model` must reach this field",
    note = "for a module of yours, put `#[memsave::model]` on its struct",
    note = "burn's BatchNorm and LocalResponseNorm compute their statistics in the input's dtype, \
            which overflows f16; its RNNs, RotaryEncoding, GaussianNoise, DeformConv2d, \
            CosineSimilarity and PairwiseDistance make fp32 tensors that meet half ones (or an \
            epsilon that vanishes in f16): keep such a field fp32 with `#[fp16(fp32)]` (an fp32 \
            island: its input cast to fp32, its output cast back)"
)]
pub trait Fp16Module: Sized {
    /// Switches mixed precision on for this module and its submodules (MMCV's
    /// `wrap_fp16_model` on this subtree).
    fn wrap_fp16(self, precision: Precision) -> Self;

    /// Calls `visit` with the identity of each module at or below this one that has a `with_cp`
    /// flag, and the flag (`#[memsave::model]` writes it; memsave's first-step check of the
    /// switches reads it). Every module of a model memsave trains is an `Fp16Module`, which is
    /// why this lives here.
    #[doc(hidden)]
    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::SegmentId, bool)) {
        let _ = visit;
    }
}

/// Prepares `model` for mixed-precision training (MMCV's `wrap_fp16_model`).
///
/// Sets `fp16_enabled` to `Fp16::On(precision)` on the model and every submodule that has the
/// flag, casts every float parameter to `precision` (islands keep theirs fp32). Parameter ids are
/// kept, so optimizers and `GradientsParams` still match.
pub fn wrap_fp16_model<M: Fp16Module>(model: M, precision: Precision) -> M {
    model.wrap_fp16(precision)
}

/// Casts every fp32 float parameter of `module` to `precision`, keeping ids and `require_grad`
/// (the half parameters are new leaves of the autodiff graph).
///
/// Burn 0.22's running statistics (`RunningState`, BatchNorm's) are shared between a module and
/// its clones and are cast in place: cast a module holding them only where the original goes
/// too (`wrap_fp16_model` never reaches them: BatchNorm is an island).
pub fn cast_params<M: Module>(module: M, precision: Precision) -> M {
    module.map(&mut ParamCaster {
        from: DType::F32,
        to: precision.dtype(),
    })
}

/// The [`ModuleMapper`] behind [`cast_params`].
struct ParamCaster {
    from: DType,
    to: DType,
}

impl ModuleMapper for ParamCaster {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (from, to) = (self.from, self.to);
        param.map(|tensor| cast_leaf(tensor, from, to))
    }
}

/// Casts a parameter's value as a new leaf, so the cast itself is not recorded in the graph.
pub(crate) fn cast_leaf<const D: usize>(tensor: Tensor<D>, from: DType, to: DType) -> Tensor<D> {
    if tensor.dtype() != from {
        return tensor;
    }
    let require_grad = tensor.is_require_grad();
    let cast = tensor.cast(to).detach();
    if require_grad {
        cast.require_grad()
    } else {
        cast
    }
}

/// What the macros generate code against. Not a stable API.
#[doc(hidden)]
pub mod __private {
    /// The answers of `__memsave_mark_FIELD` and of the mark probe that `#[auto_fp16]`'s
    /// first-layer guard asks (memsave-common: they name nothing of Burn's).
    pub use memsave_common::checkpoint::__private::{
        both, Both, MarkProbe, MarkViaFallback, MarkViaTrait, Marked, Unmarked,
    };
}
