//! Mixed precision: the `fp16_enabled` flag, [`Fp16Module`] and [`wrap_fp16_model`].
//!
//! MMCV 1.x semantics: a module carries an `fp16_enabled` flag, off by default; its methods
//! marked `#[auto_fp16]` cast their fp32 tensor arguments to half when the flag is on, and those
//! marked `#[force_fp32]` cast half arguments back to fp32. [`wrap_fp16_model`] switches the
//! flag on in the model and every submodule, casts the float parameters to half, and keeps the
//! normalisation layers ([`crate::nn::BatchNorm`], [`crate::nn::GroupNorm`]) in fp32.
//!
//! memsave goes further than MMCV in three ways: the half type is chosen per model
//! ([`Precision::F16`] or [`Precision::Bf16`]); any layer can be kept in fp32 as an *island*
//! ([`Fp32`], `#[fp16(fp32)]` on a field), its inputs cast to fp32 and its outputs cast back;
//! and a layer that is unsafe in half precision (Burn's normalisations, whose variance
//! overflows f16, or `Softplus`) is a compile error that says so, not a silent zero at run time.
//!
//! | `burn::nn` layers | under `wrap_fp16_model` |
//! |---|---|
//! | Linear, Embedding, Conv*, ConvTranspose*, PRelu, SwiGlu, Activation, GateController, MultiHeadAttention, PositionWiseFeedForward, RmsNorm | parameters cast to half |
//! | PositionalEncoding | its constant table cast to half |
//! | parameter-free activations, Dropout, pools, Interpolate, Unfold4d, losses | unchanged (compute in their input's dtype; call losses from `#[force_fp32]` methods, as MMCV does) |
//! | LayerNorm, BatchNorm, GroupNorm, InstanceNorm, LocalResponseNorm, Normalization, TransformerEncoder/Decoder (which hold LayerNorms), Softplus | not in half (f16 overflows their variance or `exp`): a compile error pointing to `#[fp16(fp32)]` or to memsave's norms |
//! | Lstm, Gru, Rnn (and Bi*), CrossAttention, DeformConv2d, RotaryEncoding, GaussianNoise | not in half (they make fp32 tensors of their own, which meet half ones): a compile error pointing to `#[fp16(fp32)]` |

mod impls;
mod island;
mod island_forward;

pub use island::Fp32;
pub use island_forward::{MhaInput, TransformerDecoderInput, TransformerEncoderInput};

use std::fmt;

use burn::module::{
    AutodiffModule, Content, Devices, EmptyRecord, Module, ModuleDisplay, ModuleDisplayDefault,
    ModuleMapper, ModuleVisitor, Param,
};
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

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

impl<B: Backend> Module<B> for Fp16 {
    type Record = EmptyRecord;

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        devices
    }

    fn fork(self, _device: &B::Device) -> Self {
        self
    }

    fn to_device(self, _device: &B::Device) -> Self {
        self
    }

    fn visit<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper<B>>(self, _mapper: &mut M) -> Self {
        self
    }

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }

    fn into_record(self) -> Self::Record {
        EmptyRecord::new()
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for Fp16 {
    type InnerModule = Fp16;

    fn valid(&self) -> Self::InnerModule {
        *self
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        module
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
/// its float parameters to half (unless it is a normalisation layer that stays fp32), and
/// recurses into its submodules.
///
/// Implemented by `#[memsave::model]` structs, by memsave's layers, by the layers of `burn::nn`
/// that run in half precision, by [`Fp32`] islands, by containers of such modules, and (doing
/// nothing) by plain values. Left out on purpose (see the table in the [module docs](self)):
/// Burn's normalisations, the transformers that hold them and `Softplus` (f16 overflows them),
/// and the layers that make fp32 tensors of their own. Keep them fp32 with `#[fp16(fp32)]`, or
/// use [`crate::nn::BatchNorm`], [`crate::nn::GroupNorm`] and [`crate::nn::LayerNorm`], which
/// stay fp32 by themselves.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be part of a mixed-precision model: it does not implement `Fp16Module`",
    label = "`wrap_fp16_model` must reach this field",
    note = "for a module of yours, put `#[memsave::model]` on its struct",
    note = "burn's normalisations (LayerNorm, BatchNorm, GroupNorm, InstanceNorm, LocalResponseNorm), \
            the transformers that hold them and Softplus overflow in f16; its RNNs, CrossAttention, \
            DeformConv2d, RotaryEncoding and GaussianNoise make fp32 tensors that meet half ones: \
            keep such a field fp32 with `#[fp16(fp32)]` (an fp32 island: its input cast to fp32, \
            its output cast back)",
    note = "memsave's `nn::LayerNorm`, `nn::BatchNorm`, `nn::GroupNorm` and `nn::GaussianNoise` \
            need no island: they take half inputs and keep fp32 statistics by themselves"
)]
pub trait Fp16Module: Sized {
    /// Switches mixed precision on for this module and its submodules (MMCV's
    /// `wrap_fp16_model` on this subtree).
    fn wrap_fp16(self, precision: Precision) -> Self;

    /// Calls `visit` with the identity of each module at or below this one that has a `with_cp`
    /// flag, and the flag (`#[memsave::model]` writes it; see
    /// [`crate::check::switched_on_without_segment`]). Every module of a model the runner
    /// trains is an `Fp16Module`, which is why this lives here.
    #[doc(hidden)]
    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(crate::checkpoint::id::SegmentId, bool)) {
        let _ = visit;
    }
}

/// Prepares `model` for mixed-precision training (MMCV's `wrap_fp16_model`).
///
/// Sets `fp16_enabled` to `Fp16::On(precision)` on the model and every submodule that has the
/// flag, casts every float parameter to `precision`, and keeps the parameters of normalisation
/// layers in fp32. Parameter ids are kept, so optimizers and `GradientsParams` still match.
pub fn wrap_fp16_model<M: Fp16Module>(model: M, precision: Precision) -> M {
    model.wrap_fp16(precision)
}

/// Casts every fp32 float parameter of `module` to `precision`, keeping ids and `require_grad`
/// (the half parameters are new leaves of the autodiff graph).
pub fn cast_params<B: Backend, M: Module<B>>(module: M, precision: Precision) -> M {
    module.map(&mut ParamCaster {
        from: DType::F32,
        to: precision.dtype(),
    })
}

/// Casts every float parameter of `module` in `from` to `to` (bf16 weights to an f16 forward
/// copy), keeping ids and `require_grad`.
pub(crate) fn recast_params<B: Backend, M: Module<B>>(module: M, from: DType, to: DType) -> M {
    module.map(&mut ParamCaster { from, to })
}

/// The [`ModuleMapper`] behind [`cast_params`].
struct ParamCaster {
    from: DType,
    to: DType,
}

impl<B: Backend> ModuleMapper<B> for ParamCaster {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (from, to) = (self.from, self.to);
        param.map(|tensor| cast_leaf(tensor, from, to))
    }
}

/// Casts a parameter's value as a new leaf, so the cast itself is not recorded in the graph.
pub(crate) fn cast_leaf<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    from: DType,
    to: DType,
) -> Tensor<B, D> {
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
