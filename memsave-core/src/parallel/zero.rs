//! Optimizer state and gradients sharded across the peers (ZeRO stages 1 and 2, Rajbhandari et
//! al. 2020; PyTorch's `ZeroRedundancyOptimizer` is stage 1). The parameters are split, in the
//! model's order, into one contiguous run per peer, balanced by bytes ([`partition`]). Each peer
//! steps only its run: the optimizer keeps state for it alone (1/N of what Adam keeps). At stage
//! 2 the gradients are averaged as backward makes them, each kept by its owner only and dropped
//! by the others at once (`super::in_backward`), so that no peer ever holds the whole set (on
//! Burn's autodiff; on another backend they are averaged after backward, then dropped). After
//! the step every peer receives every run's new values (`share_stepped`).
//!
//! burn-collective 0.21 has no reduce-scatter or all-gather: both are all-reduces here, in which
//! the peers that do not own a value contribute -0.0. Adding -0.0 changes no float (not even
//! -0.0 itself), so the result is the owner's bits: exact, at twice an all-gather's traffic.
//!
//! Exactness: every peer averages the same gradients as plain data parallelism (an all-reduce
//! adds element by element, alone or in a bucket); the global norm is combined from the
//! owners' per-parameter parts in the model's order (the same additions as one peer makes over
//! all of them); each parameter is stepped by its owner with those gradients and its own state.
//! The weights after each step are plain data parallelism's, bit for bit.

use std::collections::HashSet;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use super::{all_reduce_tensor, all_reduce_values, Collective, Reduce};
use crate::train::grads;
use crate::{Error, Result};

pub use memsave_common::parallel::{partition, ZeroStage};

/// The trainable parameters of `model`, in its order, with their bytes (fp32 masters: 4 a
/// value).
fn trainable<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> Vec<(ParamId, u64)> {
    struct Collect(Vec<(ParamId, u64)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.is_require_grad() {
                let elements: usize = param.lazy_shape().iter().product();
                self.0.push((param.id, elements as u64 * 4));
            }
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// Each trainable parameter's position in `model`'s order, by id (the same position on every
/// peer, unlike the ids).
pub(crate) fn positions<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
) -> std::collections::HashMap<ParamId, u64> {
    trainable::<B, M>(model)
        .into_iter()
        .enumerate()
        .map(|(position, (id, _))| (id, position as u64))
        .collect()
}

/// The trainable parameters peer `rank` of `world` owns.
pub fn owned<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    rank: usize,
    world: usize,
) -> HashSet<ParamId> {
    let params = trainable::<B, M>(model);
    let sizes: Vec<u64> = params.iter().map(|(_, bytes)| *bytes).collect();
    partition(&sizes, world)
        .into_iter()
        .zip(params)
        .filter(|(owner, _)| *owner == rank)
        .map(|(_, (id, _))| id)
        .collect()
}

/// Bytes of trainable parameters each peer owns.
pub fn owned_bytes<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M, world: usize) -> Vec<u64> {
    let params = trainable::<B, M>(model);
    let sizes: Vec<u64> = params.iter().map(|(_, bytes)| *bytes).collect();
    let mut bytes = vec![0; world.max(1)];
    for (owner, size) in partition(&sizes, world).into_iter().zip(sizes) {
        bytes[owner] += size;
    }
    bytes
}

/// Drops the gradients of the parameters this peer does not own.
pub(crate) fn keep_owned<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    owned: &HashSet<ParamId>,
) {
    struct Drop<'a> {
        grads: &'a mut GradientsParams,
        owned: &'a HashSet<ParamId>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Drop<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !self.owned.contains(&param.id) {
                self.grads.remove::<B::InnerBackend, D>(param.id);
            }
        }
    }
    model.visit(&mut Drop { grads, owned });
}

/// The global `norm_type`-norm of the gradients, each held by one peer (its owner): the
/// per-parameter parts are gathered and added in the model's order, as one peer holding them
/// all adds them ([`grads::global_norm`]). `None` when no peer has a gradient.
pub(crate) fn sharded_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    collective: &dyn Collective<B::InnerBackend>,
    model: &M,
    grads: &GradientsParams,
    norm_type: f64,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Result<Option<f64>> {
    struct Parts<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        norm_type: f64,
        // This peer's part of each, where it has the gradient.
        parts: Vec<Option<Tensor<B::InnerBackend, 1>>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Parts<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let part = self
                .grads
                .get::<B::InnerBackend, D>(param.id)
                .map(|grad| grads::norm_part(grad, self.norm_type));
            self.parts.push(part);
        }
    }
    let mut parts = Parts::<B> {
        grads,
        norm_type,
        parts: Vec::new(),
    };
    model.visit(&mut parts);
    gather_norm(collective, parts.parts, norm_type, device)
}

/// The global `norm_type`-norm from per-parameter parts in the model's order, each held by one
/// peer (`None` on the others): gathered (the others contribute -0.0, with whether they hold
/// it) and added in that order in f32, as [`grads::combine_norm`] adds them on one peer.
pub(crate) fn gather_norm<K: burn::prelude::Backend>(
    collective: &dyn Collective<K>,
    parts: Vec<Option<Tensor<K, 1>>>,
    norm_type: f64,
    device: &K::Device,
) -> Result<Option<f64>> {
    let count = parts.len();
    // Each part's value where this peer has it, -0.0 elsewhere; then whether it has it.
    let mine: Vec<Tensor<K, 1>> = parts
        .iter()
        .map(|part| match part {
            Some(part) => part.clone().cast(DType::F32),
            None => Tensor::from_data(TensorData::new(vec![-0.0f32], [1]), device),
        })
        .chain(parts.iter().map(|part| {
            Tensor::from_data(
                TensorData::new(vec![part.is_some() as u8 as f32], [1]),
                device,
            )
        }))
        .collect();
    if mine.is_empty() {
        return Ok(None);
    }
    let gathered = all_reduce_tensor(collective, Tensor::cat(mine, 0), Reduce::Sum)?;
    let values = gathered
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|error| Error::invalid("gradient norm", format!("{error:?}")))?;
    let (values, present) = values.split_at(count);
    let mut total: Option<f32> = None;
    for (value, present) in values.iter().zip(present) {
        if *present == 0.0 {
            continue;
        }
        total = Some(match total {
            None => *value,
            Some(total) if norm_type.is_infinite() => total.max(*value),
            Some(total) => total + value,
        });
    }
    Ok(total.map(|total| {
        let total = total as f64;
        if norm_type.is_infinite() {
            total
        } else {
            total.powf(1.0 / norm_type)
        }
    }))
}

/// Bytes of parameters shared between two replacements of the model in
/// [`share_stepped`]: the old values of one run of this size live beside the new ones.
const SHARE_BYTES: u64 = 8 << 20;

/// Every trainable parameter's value from its owner, on every peer: an all-reduce per
/// parameter, the others contributing -0.0 (exact). The model is replaced a run of about
/// [`SHARE_BYTES`] at a time, so that only one run's old values live beside their new ones (the
/// model mapped is a clone of `model`'s handles: until `model` is replaced, it keeps every old
/// value of the run alive).
pub(crate) fn share_stepped<B: AutodiffBackend, M: AutodiffModule<B>>(
    collective: &dyn Collective<B::InnerBackend>,
    model: &mut M,
    owned: &HashSet<ParamId>,
) -> Result<()> {
    struct Share<'a, B: AutodiffBackend> {
        collective: &'a dyn Collective<B::InnerBackend>,
        owned: &'a HashSet<ParamId>,
        run: &'a HashSet<ParamId>,
        error: Option<Error>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Share<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if self.error.is_some() || !self.run.contains(&param.id) {
                return param;
            }
            let mine = self.owned.contains(&param.id);
            let collective = self.collective;
            let mut error = None;
            let param = param.map(|tensor| {
                let value = tensor.inner();
                let sent = if mine {
                    value.clone()
                } else {
                    value.zeros_like().neg()
                };
                match all_reduce_tensor(collective, sent, Reduce::Sum) {
                    Ok(received) => Tensor::<B, D>::from_inner(received).require_grad(),
                    Err(e) => {
                        error = Some(e);
                        Tensor::<B, D>::from_inner(value).require_grad()
                    }
                }
            });
            self.error = error;
            param
        }
    }
    let mut run = HashSet::new();
    let mut bytes = 0;
    let params = trainable::<B, M>(model);
    let last = params.len().saturating_sub(1);
    for (index, (id, size)) in params.into_iter().enumerate() {
        run.insert(id);
        bytes += size;
        if bytes < SHARE_BYTES && index < last {
            continue;
        }
        let mut share = Share::<B> {
            collective,
            owned,
            run: &run,
            error: None,
        };
        *model = model.clone().map(&mut share);
        if let Some(error) = share.error {
            return Err(error);
        }
        run.clear();
        bytes = 0;
    }
    Ok(())
}

/// Elements of one all-reduce when bytes are gathered: 4 Mi values (16 MiB in fp32).
const GATHER_CHUNK: usize = 4 << 20;

/// Every peer's `mine`, on every peer, in rank order (an all-gather of bytes: two bytes a
/// value, exact in fp32; the others contribute -0.0).
pub(crate) fn gather_bytes<B: burn::prelude::Backend>(
    collective: &dyn Collective<B>,
    mine: &[u8],
    device: &B::Device,
) -> Result<Vec<Vec<u8>>> {
    let world = collective.world_size();
    let rank = collective.rank();
    // Each peer's length, as two 24-bit halves (exact in fp32).
    let mut lengths = vec![0.0; 2 * world];
    lengths[2 * rank] = (mine.len() >> 24) as f64;
    lengths[2 * rank + 1] = (mine.len() & 0xFF_FFFF) as f64;
    let lengths = all_reduce_values(collective, &lengths, Reduce::Sum, device)?;
    let lengths: Vec<usize> = lengths
        .chunks(2)
        .map(|pair| ((pair[0] as usize) << 24) + pair[1] as usize)
        .collect();
    // Two bytes a value; each peer's values start where the previous peer's end.
    let values: Vec<usize> = lengths.iter().map(|length| length.div_ceil(2)).collect();
    let starts: Vec<usize> = values
        .iter()
        .scan(0, |start, count| {
            let this = *start;
            *start += count;
            Some(this)
        })
        .collect();
    let total: usize = values.iter().sum();
    let my_values: Vec<f32> = mine
        .chunks(2)
        .map(|pair| (pair[0] as u32 + ((*pair.get(1).unwrap_or(&0) as u32) << 8)) as f32)
        .collect();
    let mut all = Vec::with_capacity(total);
    let mut offset = 0;
    while offset < total {
        let end = (offset + GATHER_CHUNK).min(total);
        let mut chunk = vec![-0.0f32; end - offset];
        let (mine_from, mine_to) = (starts[rank], starts[rank] + values[rank]);
        for (i, slot) in chunk.iter_mut().enumerate() {
            let at = offset + i;
            if at >= mine_from && at < mine_to {
                *slot = my_values[at - mine_from];
            }
        }
        let length = chunk.len();
        let tensor = Tensor::<B, 1>::from_data(TensorData::new(chunk, [length]), device);
        let summed = all_reduce_tensor(collective, tensor, Reduce::Sum)?;
        let summed = summed
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .map_err(|error| Error::invalid("optimizer state", format!("{error:?}")))?;
        all.extend(summed);
        offset = end;
    }
    Ok((0..world)
        .map(|peer| {
            let mut bytes = Vec::with_capacity(lengths[peer]);
            for value in &all[starts[peer]..starts[peer] + values[peer]] {
                let value = *value as u32;
                bytes.push((value & 0xFF) as u8);
                bytes.push((value >> 8) as u8);
            }
            bytes.truncate(lengths[peer]);
            bytes
        })
        .collect())
}
