//! Optimizer state stored block-wise in 8 bits (Dettmers et al., "8-bit Optimizers via
//! Block-wise Quantization", ICLR 2022; bitsandbytes; torchao's `AdamW8bit`): a state tensor is
//! cut into blocks of [`BLOCK`] values, each block scaled by its largest magnitude (kept in
//! fp32) into `[-1, 1]`, and each value stored as the index (one byte) of the nearest value of
//! the *dynamic* map, which spends its 256 values on seven decades (as a float's exponent
//! does), so that the small values of a moment survive where a linear map would round them to
//! zero. Signed for momenta, unsigned (twice as fine, its lowest value a floor rather than zero:
//! [`UNSIGNED_FLOOR`]) for Adam's second moment. Tensors of
//! fewer than [`MIN_ELEMENTS`] values stay fp32, as in bitsandbytes and torchao.
//!
//! A state tensor in 8 bits takes a quarter of its fp32 bytes, plus one fp32 scale per block
//! (1.6 %). It is dequantized for a step, updated in fp32, and quantized again; checkpoints hold
//! the bytes and scales as they are, so a resumed run continues with the same bits.

use burn::prelude::Backend;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::{DType, Int, IntDType, Tensor, TensorData, TensorPrimitive};
use serde::{Deserialize, Serialize};

pub use memsave_common::quant::{dynamic_map, BLOCK, MIN_ELEMENTS, UNSIGNED_FLOOR};

/// Values quantized at once: bounds the temporaries of quantizing a large tensor to a few MiB.
const CHUNK: usize = 1 << 18;

/// Indices of the nearest values of the sorted `map` (256 values) to `x` (values in the
/// map's range): a branch-free binary search (eight gathers), then rounding to the nearer
/// neighbour.
fn nearest<K: Backend>(x: Tensor<K, 1>, map: &Tensor<K, 1>) -> Tensor<K, 1, Int> {
    let device = x.device();
    let mut codes = Tensor::<K, 1, Int>::zeros([x.dims()[0]], &device);
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

/// One state tensor as the optimizer keeps it: fp32, or block-wise 8 bits.
#[derive(Clone, Debug)]
pub enum StateTensor<B: Backend, const D: usize> {
    /// fp32 (a tensor of fewer than [`MIN_ELEMENTS`] values, or 8 bits not asked for).
    Full(Tensor<B, D>),
    /// 8 bits: the codes (`u8`, padded to whole blocks), one scale per block, the shape, and
    /// whether the map is signed.
    Blocks {
        /// The 8-bit codes, one per value, padded to whole blocks.
        codes: Tensor<B, 1, Int>,
        /// Each block's largest magnitude: its scale.
        absmax: Tensor<B, 1>,
        /// The tensor's shape.
        shape: [usize; D],
        /// Whether the map is signed (momentum, Adam's first moment) or not (the second).
        signed: bool,
    },
}

impl<B: Backend, const D: usize> StateTensor<B, D> {
    /// `value` as it is kept: in 8 bits when `eight_bit` and it is large enough, else as is.
    pub fn store(value: Tensor<B, D>, eight_bit: bool, signed: bool) -> Self {
        if !eight_bit || value.shape().num_elements() < MIN_ELEMENTS {
            return StateTensor::Full(value);
        }
        quantize(value, signed)
    }

    /// The value, in fp32.
    pub fn load(&self) -> Tensor<B, D> {
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
    pub fn to_device(self, device: &B::Device) -> Self {
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
pub fn quantize<B: Backend, const D: usize>(
    value: Tensor<B, D>,
    signed: bool,
) -> StateTensor<B, D> {
    let shape: [usize; D] = value.dims();
    let device = value.device();
    let n = value.shape().num_elements();
    let blocks = n.div_ceil(BLOCK);
    let mut flat: Tensor<B, 1> = value.cast(DType::F32).reshape([n]);
    if blocks * BLOCK > n {
        flat = Tensor::cat(vec![flat, Tensor::zeros([blocks * BLOCK - n], &device)], 0);
    }
    let values = dynamic_map(signed);
    if let Some((codes, absmax)) = crate::nn::quantize_blocks::<B>(
        flat.clone().into_primitive().tensor(),
        values.clone(),
        BLOCK,
    ) {
        return StateTensor::Blocks {
            codes: Tensor::from_primitive(codes),
            absmax: Tensor::from_primitive(TensorPrimitive::Float(absmax)),
            shape,
            signed,
        };
    }
    quantize_ops(flat, &values, shape, signed)
}

/// [`quantize`] as tensor ops (any backend; the one a backend without its own kernel runs).
fn quantize_ops<B: Backend, const D: usize>(
    flat: Tensor<B, 1>,
    values: &[f32],
    shape: [usize; D],
    signed: bool,
) -> StateTensor<B, D> {
    let device = flat.device();
    let blocks = flat.dims()[0] / BLOCK;
    let map = Tensor::<B, 1>::from_floats(values, &device);
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

/// The fp32 value of quantized blocks.
fn dequantize<B: Backend, const D: usize>(
    codes: &Tensor<B, 1, Int>,
    absmax: &Tensor<B, 1>,
    shape: [usize; D],
    signed: bool,
) -> Tensor<B, D> {
    let device = absmax.device();
    let blocks = absmax.dims()[0];
    let n: usize = shape.iter().product();
    let map = dynamic_map(signed);
    let own = crate::nn::dequantize_blocks::<B>(
        codes.clone().into_primitive(),
        absmax.clone().into_primitive().tensor(),
        map.clone(),
        BLOCK,
    );
    let values = match own {
        Some(values) => Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(values)),
        None => Tensor::<B, 1>::from_floats(map.as_slice(), &device)
            .select(0, codes.clone().cast(IntDType::I32))
            .reshape([blocks, BLOCK])
            .mul(absmax.clone().reshape([blocks, 1]))
            .reshape([blocks * BLOCK]),
    };
    let values = if blocks * BLOCK > n {
        values.slice([0..n])
    } else {
        values
    };
    values.reshape(shape)
}

/// How a [`StateTensor`] is written: the codes as bytes and the scales as they are (fp32
/// state: its values), so that a resumed run continues with the same bits.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StateTensorItem {
    shape: Vec<usize>,
    signed: bool,
    codes: Vec<u8>,
    absmax: Vec<f32>,
    full: Option<Vec<f32>>,
}

impl<B: Backend, const D: usize> Record<B> for StateTensor<B, D> {
    type Item<S: PrecisionSettings> = StateTensorItem;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        let floats = |tensor: Tensor<B, 1>| -> Vec<f32> {
            tensor
                .into_data()
                .convert::<f32>()
                .to_vec()
                .expect("fp32 values")
        };
        match self {
            StateTensor::Full(value) => StateTensorItem {
                shape: value.dims().to_vec(),
                signed: false,
                codes: Vec::new(),
                absmax: Vec::new(),
                full: Some(floats(value.cast(DType::F32).flatten(0, D - 1))),
            },
            StateTensor::Blocks {
                codes,
                absmax,
                shape,
                signed,
            } => StateTensorItem {
                shape: shape.to_vec(),
                signed,
                codes: codes
                    .into_data()
                    .convert::<u8>()
                    .to_vec()
                    .expect("byte codes"),
                absmax: floats(absmax),
                full: None,
            },
        }
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, device: &B::Device) -> Self {
        let mut shape = [0; D];
        for (dim, size) in shape.iter_mut().zip(&item.shape) {
            *dim = *size;
        }
        match item.full {
            Some(values) => {
                StateTensor::Full(Tensor::from_data(TensorData::new(values, shape), device))
            }
            None => {
                let len = item.codes.len();
                let blocks = item.absmax.len();
                StateTensor::Blocks {
                    codes: Tensor::from_data(
                        TensorData::new(item.codes, [len]),
                        (device, DType::U8),
                    ),
                    absmax: Tensor::from_data(TensorData::new(item.absmax, [blocks]), device),
                    shape,
                    signed: item.signed,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type K = Flex;

    #[test]
    fn the_dynamic_maps_span_seven_decades_in_256_sorted_values() {
        for signed in [true, false] {
            let map = dynamic_map(signed);
            assert_eq!(map.len(), 256);
            assert!(
                map.windows(2).all(|pair| pair[0] < pair[1]),
                "sorted, distinct"
            );
            assert_eq!(*map.last().unwrap(), 1.0);
            // Exact zero for momenta; none for the second moment (its floor instead).
            assert_eq!(map.contains(&0.0), signed);
            let smallest = map
                .iter()
                .filter(|v| **v > UNSIGNED_FLOOR)
                .fold(1.0f32, |a, b| a.min(*b));
            // The first decade's one (signed) or two (unsigned) midpoints of [0.1, 1] x 1e-6.
            let expected = if signed { 0.55e-6 } else { 0.325e-6 };
            assert!((smallest - expected).abs() < 1e-12, "{smallest}");
        }
        assert_eq!(
            dynamic_map(true)[0],
            -0.99296875,
            "the last decade's 64 midpoints"
        );
        assert_eq!(dynamic_map(false)[0], UNSIGNED_FLOOR);
    }

    #[test]
    fn a_zero_second_moment_beside_a_large_one_is_stored_as_the_floor_not_zero() {
        let device = Default::default();
        // One block: a large second moment, the rest zero or far below it (1e-9 of it).
        let mut values = vec![0.0f32; MIN_ELEMENTS];
        values[0] = 4.0;
        values[1] = 4e-9;
        let tensor = Tensor::<K, 1>::from_floats(values.as_slice(), &device);
        let back: Vec<f32> = StateTensor::store(tensor, true, false)
            .load()
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(back[0], 4.0);
        // Adam divides by sqrt(v) + 1e-8: 2e-7 (the floor times 4) keeps that step bounded.
        assert_eq!(back[1], UNSIGNED_FLOOR * 4.0);
        assert_eq!(back[2], UNSIGNED_FLOOR * 4.0);
        // A block of zeros only stays (all but) zero: its scale is clamped at 1e-12.
        assert!(back[BLOCK..].iter().all(|v| *v <= UNSIGNED_FLOOR * 1e-12));
    }

    #[test]
    fn values_on_the_map_round_trip_exactly_and_others_to_their_nearest() {
        let device = Default::default();
        let map = dynamic_map(true);
        // One block of 4096 values: every map value times 3 (the block's scale), repeated.
        let values: Vec<f32> = (0..4096).map(|i| map[i % 256] * 3.0).collect();
        let tensor = Tensor::<K, 1>::from_floats(values.as_slice(), &device);
        let stored = StateTensor::store(tensor, true, true);
        assert!(matches!(stored, StateTensor::Blocks { .. }));
        let back: Vec<f32> = stored.load().into_data().to_vec().unwrap();
        for (a, b) in values.iter().zip(&back) {
            assert!((a - b).abs() <= 3e-7 * a.abs().max(1.0), "{a} -> {b}");
        }
        // Random values: within half the widest gap of the map (0.9 / 64 near 1), block by block.
        let mut state = 7u64;
        let values: Vec<f32> = (0..10_000)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 10.0
            })
            .collect();
        let tensor =
            Tensor::<K, 2>::from_data(TensorData::new(values.clone(), [100, 100]), &device);
        let back: Vec<f32> = StateTensor::store(tensor, true, true)
            .load()
            .into_data()
            .to_vec()
            .unwrap();
        for (block, (a, b)) in values.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
            let absmax = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let worst = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                worst <= absmax * 0.9 / 64.0 / 2.0 * 1.001,
                "block {block}: {worst}"
            );
        }
    }

    #[test]
    fn flexs_kernel_gives_the_tensor_ops_codes() {
        let device = Default::default();
        for signed in [true, false] {
            let n = BLOCK * 40;
            let x =
                Tensor::<K, 1>::random([n], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
            // Magnitudes over ten decades, zeros, and (unsigned) non-negative values only.
            let x = x.clone().mul(x.clone().mul_scalar(4.0).exp());
            let x = if signed { x } else { x.abs() };
            let x = x.slice([0..n - 7]).reshape([n - 7]);
            let padded = Tensor::cat(vec![x.clone(), Tensor::zeros([7], &device)], 0);
            let ops = quantize_ops::<K, 1>(padded, &dynamic_map(signed), [n - 7], signed);
            let kernel = quantize(x, signed);
            let parts = |q: StateTensor<K, 1>| match q {
                StateTensor::Blocks { codes, absmax, .. } => (
                    codes.into_data().convert::<u8>().to_vec::<u8>().unwrap(),
                    absmax.into_data().to_vec::<f32>().unwrap(),
                ),
                StateTensor::Full(_) => panic!("8 bits"),
            };
            assert!(parts(ops) == parts(kernel), "signed {signed}");
        }
    }

    #[test]
    fn small_tensors_stay_fp32_and_8_bits_take_a_quarter() {
        let device = Default::default();
        let small = Tensor::<K, 1>::ones([MIN_ELEMENTS - 1], &device);
        assert!(matches!(
            StateTensor::store(small, true, true),
            StateTensor::Full(_)
        ));
        let large = Tensor::<K, 1>::ones([1 << 16], &device);
        let stored = StateTensor::store(large, true, false);
        assert_eq!(stored.bytes(), (1 << 16) + (1 << 16) / BLOCK * 4);
        let StateTensor::Blocks { codes, .. } = &stored else {
            panic!("8 bits")
        };
        assert_eq!(codes.dtype(), DType::U8);
    }
}
