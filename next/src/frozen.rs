//! Frozen weights held compressed on Burn 0.22 (`[optimizer] frozen_dtype = "int8"` or
//! `"bf16"`, `OptimizerHook::with_frozen_dtype`, or [`compress_frozen`] in a user's own loop):
//! the weights that do not train (MMDetection's `frozen_stages`, a frozen submodule: a float
//! parameter of rank 2 or more without `require_grad`) are held as int8 or bf16.
//!
//! int8 is Burn 0.22's own quantization (`Tensor::quantize_dynamic`: min-max calibration, as
//! burn-core's `Quantizer`): symmetric int8 codes with one fp32 scale per tensor ([`int8_scheme`]
//! says why not per channel, as on 0.21), a quarter of fp32's bytes. Every op of Burn's
//! dequantizes a quantized operand where it reads it (burn-tensor `bridge/kind.rs`,
//! `into_float`; a matmul's `q_matmul` into the other operand's type), so any layer, Burn's own
//! included, reads a frozen int8 weight without a change to its code, and computes with the
//! weight's int8 values (the dequantized copy is the op's own, freed with it). On 0.21 only
//! memsave's layers could (through `weight_of`). The cost: a convolution dequantizes into the
//! device's float type (fp32), so int8 needs an fp32 forward; a half forward (mixed precision,
//! 16-bit weights) holds its frozen weights in its own type (`"bf16"`: no fp32 master beside the
//! half copy, which shares them where the types agree).
//!
//! A quantized tensor is not wrapped by autodiff: a frozen weight is a constant of every
//! segment and gets no gradient, as a frozen weight should. Snapshots hold the int8 codes and
//! scales as they are.

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::quantization::{QuantScheme, QuantStore, ScaleDtype};
use burn::tensor::DType;

use crate::backend;

pub use memsave_common::weights::FrozenDtype;

/// What [`compress_frozen`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrozenFigures {
    /// Frozen weights compressed.
    pub count: usize,
    /// The bytes they are held in now (codes and scales).
    pub held_bytes: u64,
    /// The bytes they took before.
    pub before_bytes: u64,
}

/// `model` with its frozen weights held as `dtype` (see the module docs), and what was done.
pub fn compress_frozen<M: Module>(model: M, dtype: FrozenDtype) -> (M, FrozenFigures) {
    let mut compress = Compress {
        dtype,
        figures: FrozenFigures::default(),
    };
    let model = model.map(&mut compress);
    (model, compress.figures)
}

/// The int8 scheme: symmetric codes with one fp32 scale per tensor. Burn 0.22.1's block scales
/// would be finer, but a block-scaled tensor on Flex reads other values once reshaped (Burn's
/// `linear` reshapes its weight: `unsqueeze`, measured 4.7e-3 off on a 64 x 512 weight with
/// blocks of 128), so memsave waits for Burn's fix; a per-tensor scale survives every op.
pub fn int8_scheme() -> QuantScheme {
    QuantScheme::default()
        .with_store(QuantStore::Native)
        .per_tensor(ScaleDtype::F32)
}

struct Compress {
    dtype: FrozenDtype,
    figures: FrozenFigures,
}

impl ModuleMapper for Compress {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let dtype = tensor.dtype();
        let frozen = D >= 2
            && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            && backend::is_autodiff_float(&tensor.clone().into_dispatch())
            && !tensor.is_require_grad();
        if !frozen {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let shape = tensor.shape().to_vec();
        let elements: usize = shape.iter().product();
        self.figures.count += 1;
        self.figures.before_bytes += (elements * dtype.size()) as u64;
        let held = match self.dtype {
            FrozenDtype::Int8 => {
                self.figures.held_bytes += (elements + 4) as u64;
                tensor.quantize_dynamic(&int8_scheme())
            }
            FrozenDtype::Bf16 => {
                self.figures.held_bytes += (elements * 2) as u64;
                tensor.cast(DType::BF16)
            }
        };
        Param::from_mapped_value(id, held, mapper)
    }
}
