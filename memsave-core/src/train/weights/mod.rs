//! Parameter compression: the trainable weights kept in 16 bits as their only copy
//! (`[optimizer] weight_dtype = "bf16"`). The optimizer's arithmetic stays fp32: each parameter
//! is widened to fp32 for its own step only (a group of parameters at a time, or one at a time
//! in backward), stepped by the optimizer's own rule, and rounded back to 16 bits by
//! [`WeightRounding`]: stochastically (the default; torchao's `bf16_stochastic_round`), to
//! nearest, or with a 16-bit Kahan compensation per weight ("Revisiting BFloat16 Training",
//! Zamirai et al. 2020). The forward runs on the 16-bit weights themselves.
//!
//! The stochastic draws are counter-based ([`round::uniforms`]): the stream of a parameter's
//! step is a function of the run's seed, the step's number and the parameter's position in the
//! model, so a resumed run, a data-parallel peer and a ZeRO owner draw the same numbers.

pub(crate) mod model;
mod round;

use std::collections::HashMap;

use burn::module::ParamId;
use burn::prelude::Backend;
use burn::tensor::{DType, ElementConversion, Tensor, TensorData};

use crate::train::snapshot::codec::CodecError;

pub use memsave_common::weights::{StepRounding, WeightDtype, WeightRounding, WeightSpec};

/// A [`WeightDtype`]'s Burn 0.21 dtype.
pub trait WeightDtypeExt {
    /// The tensor dtype.
    fn dtype(self) -> DType;
}

impl WeightDtypeExt for WeightDtype {
    fn dtype(self) -> DType {
        match self {
            WeightDtype::F32 => DType::F32,
            WeightDtype::Bf16 => DType::BF16,
            WeightDtype::F16 => DType::F16,
        }
    }
}

/// Values rounded at once (1 MiB of fp32 per temporary).
const SLICE: usize = 1 << 18;

/// The run's 16-bit weights: the rounding of each update, the Kahan compensations, the count
/// of steps (the draws' stream), and this step's count of unchanged weights.
#[derive(Clone, Debug)]
pub struct WeightStore<K: Backend> {
    spec: WeightSpec,
    /// Optimizer steps taken so far.
    steps: u64,
    /// Each trainable parameter's position in the model (the key of its draws and its
    /// compensation: ids differ between peers and between runs).
    positions: HashMap<ParamId, u64>,
    /// Kahan's compensation per parameter position (16 bits, flat).
    carries: HashMap<u64, Tensor<K, 1>>,
    /// This step's counts so far (on the device until the step ends).
    counts: Option<(Tensor<K, 1>, Tensor<K, 1>)>,
    /// The last step's counts.
    last: Option<StepRounding>,
}

impl<K: Backend> WeightStore<K> {
    /// A store for `spec` (16 bits), no step taken.
    pub fn new(spec: WeightSpec) -> Self {
        WeightStore {
            spec,
            steps: 0,
            positions: HashMap::new(),
            carries: HashMap::new(),
            counts: None,
            last: None,
        }
    }

    /// The spec.
    pub fn spec(&self) -> WeightSpec {
        self.spec
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The last step's count of unchanged weights.
    pub fn last_step(&self) -> Option<StepRounding> {
        self.last
    }

    /// Bytes of Kahan compensation held.
    pub fn carry_bytes(&self) -> u64 {
        self.carries
            .values()
            .map(|carry| carry.shape().num_elements() as u64 * 2)
            .sum()
    }

    /// Sets the trainable parameters' positions (the model's order of trainable parameters).
    pub fn set_positions(&mut self, positions: HashMap<ParamId, u64>) {
        self.positions = positions;
    }

    /// The key of parameter `id`: its position (its id's value where the positions are not
    /// set: a store used outside a run).
    fn position(&self, id: ParamId) -> u64 {
        self.positions.get(&id).copied().unwrap_or(id.val())
    }

    /// Parameter `id`'s new 16-bit value from its old one (`old`, 16 bits) and the optimizer's
    /// fp32 result `new`, rounded by the spec's rounding.
    pub fn narrow<const D: usize>(
        &mut self,
        id: ParamId,
        old: Tensor<K, D>,
        new: Tensor<K, D>,
    ) -> Tensor<K, D> {
        let shape = new.shape();
        let n = shape.num_elements();
        let position = self.position(id);
        let (old, new) = (old.reshape([n]), new.reshape([n]));
        let mut carry = self.carries.remove(&position);
        // A slice at a time: the rounding's fp32 temporaries stay a few MiB, whatever the
        // parameter's size (the draws are indexed by the value's place, not the slice's).
        let mut stored = Vec::with_capacity(n.div_ceil(SLICE));
        let mut carries = Vec::new();
        for start in (0..n).step_by(SLICE) {
            let end = (start + SLICE).min(n);
            let slice_carry = carry
                .as_ref()
                .map(|carry| carry.clone().slice([start..end]));
            let (value, next) = self.narrow_slice(
                position,
                start,
                old.clone().slice([start..end]),
                new.clone().slice([start..end]),
                slice_carry,
            );
            stored.push(value);
            carries.extend(next);
        }
        drop((old, new, carry.take()));
        if !carries.is_empty() {
            self.carries.insert(position, Tensor::cat(carries, 0));
        }
        Tensor::cat(stored, 0).reshape(shape)
    }

    /// Values `start..` of one parameter (`old` 16-bit, `new` the optimizer's fp32 result,
    /// `carry` Kahan's compensation so far): their new 16-bit values, and Kahan's new
    /// compensation; this step's counts updated.
    fn narrow_slice(
        &mut self,
        position: u64,
        start: usize,
        old: Tensor<K, 1>,
        new: Tensor<K, 1>,
        carry: Option<Tensor<K, 1>>,
    ) -> (Tensor<K, 1>, Option<Tensor<K, 1>>) {
        let dtype = self.spec.dtype.dtype();
        let n = new.dims()[0];
        let old = old.cast(DType::F32);
        let new = new.cast(DType::F32);
        let (stored, carry) = match self.spec.rounding {
            WeightRounding::Nearest => (round::nearest(new.clone(), dtype), None),
            WeightRounding::Stochastic => {
                let key = round::splitmix64(
                    self.spec.seed ^ round::splitmix64(position ^ round::splitmix64(self.steps)),
                );
                let draws = round::uniforms(key, start, n);
                let u = Tensor::<K, 1>::from_data(TensorData::new(draws, [n]), &new.device());
                (round::stochastic(new.clone(), u, self.spec.dtype), None)
            }
            WeightRounding::Kahan => {
                let carry = match carry {
                    Some(carry) => carry.cast(DType::F32),
                    None => Tensor::zeros([n], &new.device()),
                };
                let (stored, carry) = round::kahan(old.clone(), new.clone(), carry, dtype);
                (stored, Some(carry.cast(dtype)))
            }
        };
        let moved = new.not_equal(old.clone());
        let unchanged = moved.clone().bool_and(stored.clone().equal(old));
        let (moved, unchanged) = (moved.float().sum(), unchanged.float().sum());
        self.counts = Some(match self.counts.take() {
            Some((m, u)) => (m.add(moved), u.add(unchanged)),
            None => (moved, unchanged),
        });
        (stored.cast(dtype), carry)
    }

    /// The end of an optimizer step: the step's counts read, the step counted.
    pub fn end_step(&mut self) -> Option<StepRounding> {
        self.steps += 1;
        let (moved, unchanged) = self.counts.take()?;
        let read = |t: Tensor<K, 1>| t.into_scalar().elem::<f64>();
        let figures = StepRounding {
            moved: read(moved),
            unchanged: read(unchanged),
        };
        self.last = Some(figures);
        Some(figures)
    }

    /// The store's state for a snapshot: the spec, the steps, and the compensations by
    /// position (16-bit values as they are).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.steps.to_le_bytes());
        let mut carries: Vec<_> = self.carries.iter().collect();
        carries.sort_by_key(|(position, _)| **position);
        out.extend_from_slice(&(carries.len() as u64).to_le_bytes());
        for (position, carry) in carries {
            let data = carry.to_data();
            let bytes = data.as_bytes();
            out.extend_from_slice(&position.to_le_bytes());
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    /// One store's bytes from the parts of several ([`WeightStore::to_bytes`] of each ZeRO
    /// peer, which holds the compensations of its own parameters): the steps of the first, every
    /// part's compensations, by position.
    pub fn merge_bytes(parts: &[Vec<u8>]) -> Result<Vec<u8>, CodecError> {
        let truncated = CodecError::Layout("a part of the weights' store is truncated");
        let mut steps = None;
        let mut entries: Vec<(u64, &[u8])> = Vec::new();
        for part in parts {
            let mut rest = part.as_slice();
            let mut take = |n: usize| -> Result<&[u8], CodecError> {
                let (head, tail) = rest.split_at_checked(n).ok_or(CodecError::Layout(
                    "a part of the weights' store is truncated",
                ))?;
                rest = tail;
                Ok(head)
            };
            let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("eight bytes"));
            let part_steps = u64_of(take(8)?);
            steps.get_or_insert(part_steps);
            let count = u64_of(take(8)?);
            for _ in 0..count {
                let position = u64_of(take(8)?);
                let length = u64_of(take(8)?) as usize;
                entries.push((position, take(length)?));
            }
        }
        let steps = steps.ok_or(truncated)?;
        entries.sort_by_key(|(position, _)| *position);
        entries.dedup_by_key(|(position, _)| *position);
        let mut out = steps.to_le_bytes().to_vec();
        out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        for (position, bytes) in entries {
            out.extend_from_slice(&position.to_le_bytes());
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        Ok(out)
    }

    /// Restores [`WeightStore::to_bytes`]'s state written under `saved` (the snapshot's spec):
    /// the steps always; the compensations where both keep them. Errors say what is damaged.
    pub fn load_bytes(
        &mut self,
        bytes: &[u8],
        saved: WeightSpec,
        device: &K::Device,
    ) -> Result<(), CodecError> {
        let mut rest = bytes;
        let mut take = |n: usize, what: &'static str| -> Result<&[u8], CodecError> {
            let (head, tail) = rest.split_at_checked(n).ok_or(CodecError::Layout(what))?;
            rest = tail;
            Ok(head)
        };
        let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("eight bytes"));
        let steps = u64_of(take(8, "the weights' section is truncated (step count)")?);
        let count = u64_of(take(
            8,
            "the weights' section is truncated (compensations)",
        )?);
        let mut carries = HashMap::new();
        let saved_dtype = saved.dtype.dtype();
        for _ in 0..count {
            let truncated = "a Kahan compensation in the weights' section is truncated";
            let position = u64_of(take(8, truncated)?);
            let length = u64_of(take(8, truncated)?) as usize;
            if length % 2 != 0 {
                return Err(CodecError::Layout(
                    "a Kahan compensation in the weights' section has an odd byte count",
                ));
            }
            let data = take(length, truncated)?;
            let data = TensorData::from_bytes_vec(data.to_vec(), [length / 2], saved_dtype);
            carries.insert(position, Tensor::<K, 1>::from_data(data, device));
        }
        if !rest.is_empty() {
            return Err(CodecError::Layout(
                "the weights' section has bytes after its last compensation",
            ));
        }
        if saved.rounding == WeightRounding::Kahan && count == 0 && steps > 0 {
            return Err(CodecError::Layout(
                "it was written with Kahan rounding but holds no compensation",
            ));
        }
        self.steps = steps;
        if self.spec.rounding == WeightRounding::Kahan && saved.rounding == WeightRounding::Kahan {
            let dtype = self.spec.dtype.dtype();
            self.carries = carries
                .into_iter()
                .map(|(position, carry)| (position, carry.cast(dtype)))
                .collect();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_flex::Flex;

    /// A parameter of several slices is rounded as one: the same draws (indexed by the value's
    /// place), the same bits, the counts of every slice.
    #[test]
    fn a_large_parameter_is_rounded_a_slice_at_a_time_with_the_same_bits() {
        let device = Default::default();
        let n = 2 * SLICE + 12_345;
        let spec = WeightSpec::bf16().with_seed(9);
        let mut store = WeightStore::<Flex>::new(spec);
        let values: Vec<f32> = (0..n).map(|i| 1.0 + (i % 977) as f32 * 1e-5).collect();
        let new = Tensor::<Flex, 1>::from_data(TensorData::new(values, [n]), &device);
        let old = new.clone().cast(DType::BF16);
        let id = ParamId::from(5);
        let stored = store.narrow(id, old, new.clone());
        let key = round::splitmix64(9 ^ round::splitmix64(5 ^ round::splitmix64(0)));
        let u =
            Tensor::<Flex, 1>::from_data(TensorData::new(round::uniforms(key, 0, n), [n]), &device);
        let whole = round::stochastic(new, u, WeightDtype::Bf16).cast(DType::BF16);
        assert_eq!(stored.into_data(), whole.into_data());
        let figures = store.end_step().unwrap();
        assert!(figures.moved > (2 * SLICE) as f64, "{figures:?}");
    }

    #[test]
    fn a_store_round_trips_through_its_bytes() {
        let device = Default::default();
        let spec = WeightSpec::new(WeightDtype::Bf16, WeightRounding::Kahan);
        let mut store = WeightStore::<Flex>::new(spec);
        let id = ParamId::from(3);
        let old = Tensor::<Flex, 2>::ones([2, 3], &device).cast(DType::BF16);
        let new = Tensor::<Flex, 2>::ones([2, 3], &device).add_scalar(1e-3);
        let stored = store.narrow(id, old, new);
        assert_eq!(stored.dtype(), DType::BF16);
        let figures = store.end_step().unwrap();
        assert_eq!((figures.moved, figures.unchanged), (6.0, 6.0));
        let bytes = store.to_bytes();
        let mut back = WeightStore::<Flex>::new(spec);
        back.load_bytes(&bytes, spec, &device).unwrap();
        assert_eq!(back.steps(), 1);
        assert_eq!(back.to_bytes(), bytes);
        assert!(back
            .load_bytes(&bytes[..bytes.len() - 1], spec, &device)
            .is_err());
        let mut empty = bytes[..8].to_vec();
        empty.extend_from_slice(&0u64.to_le_bytes());
        assert!(back.load_bytes(&empty, spec, &device).is_err());
    }
}
