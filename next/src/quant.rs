//! Optimizer state stored block-wise in 8 bits on Burn 0.22 (Dettmers et al., "8-bit Optimizers
//! via Block-wise Quantization", ICLR 2022; bitsandbytes; torchao's `AdamW8bit`): a state tensor
//! is cut into blocks of [`BLOCK`] values, each block scaled by its largest magnitude (kept in
//! fp32) into `[-1, 1]`, and each value stored as the index (one byte) of the nearest value of
//! the dynamic map ([`dynamic_map`]: seven decades, signed for momenta, unsigned with a floor for
//! Adam's second moment). Tensors of fewer than [`MIN_ELEMENTS`] values stay fp32.
//!
//! A state tensor in 8 bits takes a quarter of its fp32 bytes, plus one fp32 scale per block
//! (1.6 %). It is dequantized for a step, updated in fp32, and quantized again; the optimizer's
//! record holds the bytes and scales as they are, so a resumed run continues with the same bits.
//! (memsave 0.21 also has a Flex kernel for the quantization; on 0.22 it comes with the lean
//! layers' kernels, port slice 5: these tensor ops give the same codes.)

use burn::optim::{RecordState, StateSink, StateSource};
use burn::tensor::{DType, Device, Int, IntDType, Tensor, TensorData};

pub use memsave_common::quant::{dynamic_map, BLOCK, MIN_ELEMENTS, UNSIGNED_FLOOR};

/// Values quantized at once: bounds the temporaries of quantizing a large tensor to a few MiB.
const CHUNK: usize = 1 << 18;

/// One state tensor as the optimizer keeps it: fp32, or block-wise 8 bits.
#[derive(Clone, Debug)]
pub enum StateTensor<const D: usize> {
    /// fp32 (a tensor of fewer than [`MIN_ELEMENTS`] values, or 8 bits not asked for).
    Full(Tensor<D>),
    /// 8 bits: the codes (`u8`, padded to whole blocks), one scale per block, the shape, and
    /// whether the map is signed.
    Blocks {
        /// The 8-bit codes, one per value, padded to whole blocks.
        codes: Tensor<1, Int>,
        /// Each block's largest magnitude: its scale.
        absmax: Tensor<1>,
        /// The tensor's shape.
        shape: [usize; D],
        /// Whether the map is signed (momentum, Adam's first moment) or not (the second).
        signed: bool,
    },
}

impl<const D: usize> StateTensor<D> {
    /// `value` as it is kept: in 8 bits when `eight_bit` and it is large enough, else as is.
    pub fn store(value: Tensor<D>, eight_bit: bool, signed: bool) -> Self {
        if !eight_bit || value.shape().num_elements() < MIN_ELEMENTS {
            return StateTensor::Full(value);
        }
        quantize(value, signed)
    }

    /// The value, in fp32.
    pub fn load(&self) -> Tensor<D> {
        match self {
            StateTensor::Full(value) => value.clone(),
            StateTensor::Blocks {
                codes,
                absmax,
                shape,
                signed,
            } => dequantize(codes, absmax, *shape, *signed),
        }
    }

    /// Moved to `device`.
    pub fn to_device(self, device: &Device) -> Self {
        match self {
            StateTensor::Full(value) => StateTensor::Full(value.to_device(device)),
            StateTensor::Blocks {
                codes,
                absmax,
                shape,
                signed,
            } => StateTensor::Blocks {
                codes: codes.to_device(device),
                absmax: absmax.to_device(device),
                shape,
                signed,
            },
        }
    }

    /// Bytes it takes.
    pub fn bytes(&self) -> usize {
        match self {
            StateTensor::Full(value) => value.shape().num_elements() * value.dtype().size(),
            StateTensor::Blocks { codes, absmax, .. } => {
                codes.shape().num_elements() * codes.dtype().size()
                    + absmax.shape().num_elements() * 4
            }
        }
    }
}

/// `value` quantized block-wise (see the module docs).
pub fn quantize<const D: usize>(value: Tensor<D>, signed: bool) -> StateTensor<D> {
    let shape: [usize; D] = value.dims();
    let device = value.device();
    let n = value.shape().num_elements();
    let blocks = n.div_ceil(BLOCK);
    let mut flat: Tensor<1> = value.cast(DType::F32).reshape([n]);
    if blocks * BLOCK > n {
        let padding = Tensor::zeros([blocks * BLOCK - n], (&device, DType::F32));
        flat = Tensor::cat(vec![flat, padding], 0);
    }
    let map = Tensor::<1>::from_data(
        TensorData::new(dynamic_map(signed), [256]),
        (&device, DType::F32),
    );
    let absmax = flat
        .clone()
        .reshape([blocks, BLOCK])
        .abs()
        .max_dim(1)
        .clamp_min(1e-12)
        .reshape([blocks]);
    let mut codes = Vec::new();
    let per_chunk = CHUNK / BLOCK;
    for first in (0..blocks).step_by(per_chunk) {
        let last = (first + per_chunk).min(blocks);
        let scaled = flat
            .clone()
            .slice([first * BLOCK..last * BLOCK])
            .reshape([last - first, BLOCK])
            .div(
                absmax
                    .clone()
                    .slice([first..last])
                    .reshape([last - first, 1]),
            )
            .reshape([(last - first) * BLOCK]);
        codes.push(nearest(scaled, &map).cast(IntDType::U8));
    }
    let codes = if codes.len() == 1 {
        codes.pop().expect("one chunk")
    } else {
        Tensor::cat(codes, 0)
    };
    StateTensor::Blocks {
        codes,
        absmax,
        shape,
        signed,
    }
}

/// Indices of the nearest values of the sorted `map` (256 values) to `x` (values in the
/// map's range): a branch-free binary search (eight gathers), then rounding to the nearer
/// neighbour.
fn nearest(x: Tensor<1>, map: &Tensor<1>) -> Tensor<1, Int> {
    let device = x.device();
    let mut codes = Tensor::<1, Int>::zeros([x.dims()[0]], &device);
    for step in [128, 64, 32, 16, 8, 4, 2, 1] {
        let probe = codes.clone().add_scalar(step);
        let below = x
            .clone()
            .greater_equal(map.clone().select(0, probe.clone()));
        codes = codes.mask_where(below, probe);
    }
    let up = codes.clone().add_scalar(1).clamp_max(255);
    let low = map.clone().select(0, codes.clone());
    let high = map.clone().select(0, up.clone());
    let nearer_up = x
        .sub(low.clone())
        .greater_equal(high.sub(low).mul_scalar(0.5));
    codes.mask_where(nearer_up, up)
}

/// The fp32 value of quantized blocks.
fn dequantize<const D: usize>(
    codes: &Tensor<1, Int>,
    absmax: &Tensor<1>,
    shape: [usize; D],
    signed: bool,
) -> Tensor<D> {
    let device = absmax.device();
    let blocks = absmax.dims()[0];
    let n: usize = shape.iter().product();
    let map = Tensor::<1>::from_data(
        TensorData::new(dynamic_map(signed), [256]),
        (&device, DType::F32),
    );
    let values = map
        .select(0, codes.clone().cast(IntDType::I32))
        .reshape([blocks, BLOCK])
        .mul(absmax.clone().reshape([blocks, 1]))
        .reshape([blocks * BLOCK]);
    let values = if blocks * BLOCK > n {
        values.slice([0..n])
    } else {
        values
    };
    values.reshape(shape)
}

/// In the optimizer's record: fp32 state as its values (`full`), 8 bits as the codes' bytes
/// (`codes`), the scales (`absmax`), the shape (`shape`, as u64) and the map (`signed`), so that
/// a resumed run continues with the same bits.
impl<const D: usize> RecordState for StateTensor<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        match self {
            StateTensor::Full(value) => {
                out.push_tensor(prefix, "full", value.clone().cast(DType::F32).into_data())
            }
            StateTensor::Blocks {
                codes,
                absmax,
                shape,
                signed,
            } => {
                out.push_tensor(prefix, "codes", codes.clone().into_data());
                out.push_tensor(prefix, "absmax", absmax.clone().into_data());
                let dims: Vec<u64> = shape.iter().map(|dim| *dim as u64).collect();
                out.push_tensor(prefix, "shape", TensorData::new(dims, [D]));
                out.push_scalar(prefix, "signed", (*signed).into());
            }
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        if let Some(full) = src.take_tensor(prefix, "full") {
            return (full.shape().len() == D)
                .then(|| StateTensor::Full(Tensor::from_data(full, device)));
        }
        let codes = src.take_tensor(prefix, "codes")?;
        let absmax = src.take_tensor(prefix, "absmax")?;
        let dims = src.take_tensor(prefix, "shape")?.convert::<u64>();
        let signed = bool::try_from(src.take_scalar(prefix, "signed")?).ok()?;
        let dims = dims.as_slice::<u64>().ok()?;
        let shape: [usize; D] = std::array::from_fn(|i| dims.get(i).copied().unwrap_or(0) as usize);
        // A record that does not describe whole blocks of this shape is not this state.
        let n: usize = shape.iter().product();
        let blocks = absmax.shape().iter().product::<usize>();
        let padded = codes.shape().iter().product::<usize>();
        if dims.len() != D || blocks != n.div_ceil(BLOCK) || padded != blocks * BLOCK {
            return None;
        }
        Some(StateTensor::Blocks {
            codes: Tensor::from_data(codes, (device, DType::U8)),
            absmax: Tensor::from_data(absmax, (device, DType::F32)),
            shape,
            signed,
        })
    }
}
