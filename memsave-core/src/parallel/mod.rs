//! Data parallelism (MMCV's `MMDistributedDataParallel`, PyTorch's DDP) on Burn's collective
//! (burn-collective: all-reduce between peers that are threads of one process, one per device,
//! and processes on other machines through its global orchestrator). memsave writes no
//! all-reduce, transport or orchestrator of its own: it decides *what* is reduced and *when*.
//!
//! - A runner becomes a peer by parts ([`attach`], [`PeerReducer`]), not by a branch in its
//!   loop.
//! - Every peer starts from peer 0's weights ([`BroadcastHook`], before the first iteration
//!   and after a resume) and the same seed.
//! - Each peer reads its own shard of the data ([`Shard`], PyTorch's `DistributedSampler`).
//! - The optimizer hook's reduction part ([`PeerReducer`]) averages the gradients across peers
//!   at the end of each group of micro-batches, before unscaling, the overflow check and
//!   clipping ([`all_reduce_grads`]):
//!   once per group under accumulation (DDP's `no_sync` on the other micro-steps). Every peer
//!   gets the same averaged bits, so the norm, the clipping and the step are the same
//!   everywhere; the overflow decision is agreed explicitly too (`agree_any`), so loss
//!   scalers stay equal.
//! - BatchNorm statistics stay per peer (MMDetection's default; no SyncBN).
//! - Peer 0 logs and writes checkpoints; the logged loss is the mean over peers (MMDetection's
//!   `_parse_losses`).
//! - A peer that fails ends the run on every peer with an `Error::Peer` naming it
//!   (`peer::run_local`); a remote node that stops answering ends it after the peer timeout.
//!
//! The transport, Burn's collective (peers as threads, `BurnPeer`; nodes through its
//! orchestrator, over websockets on tokio), is behind the feature `parallel`; without it, the
//! parts above run on any [`Collective`] of your own.

pub(crate) mod in_backward;
mod parts;
#[cfg(feature = "parallel")]
pub mod peer;
#[cfg(feature = "parallel")]
mod topology;
pub mod zero;

use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

pub use in_backward::TapPeers;
pub use memsave_common::parallel::Shard;
pub use parts::{attach, BroadcastHook, PeerReducer};
#[cfg(feature = "parallel")]
pub use peer::{
    report_network_failure, run_local, serve_orchestrator, BurnPeer, Topology, DEFAULT_TIMEOUT,
};
pub use zero::ZeroStage;

use crate::Result;

/// How an all-reduce combines the peers' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// The sum.
    Sum,
    /// The mean.
    Mean,
}

/// One peer of a data-parallel run: its rank, the number of peers, and an all-reduce with the
/// others. Every peer must make the same calls in the same order with tensors of the same shapes.
pub trait Collective<B: Backend>: Send + Sync {
    /// This peer's rank, from 0 (rank 0 logs and saves).
    fn rank(&self) -> usize;

    /// The number of peers.
    fn world_size(&self) -> usize;

    /// The reduction of `tensor` over every peer; every peer gets the same values.
    fn all_reduce(&self, tensor: FloatTensor<B>, op: Reduce) -> Result<FloatTensor<B>>;

    /// The ranks of the peers in this peer's process, which share its host memory (itself
    /// only, unless the implementation says more).
    fn local_ranks(&self) -> std::ops::Range<usize> {
        self.rank()..self.rank() + 1
    }

    /// The shard of the data this peer reads.
    fn shard(&self) -> Shard {
        Shard {
            rank: self.rank(),
            world: self.world_size(),
        }
    }
}

/// A shared handle on a peer, as the runner's state holds it.
pub type SharedCollective<B> = Arc<dyn Collective<B>>;

/// [`Collective::all_reduce`] on a tensor of any rank.
pub(crate) fn all_reduce_tensor<B: Backend, const D: usize>(
    collective: &dyn Collective<B>,
    tensor: Tensor<B, D>,
    op: Reduce,
) -> Result<Tensor<B, D>> {
    let reduced = collective.all_reduce(tensor.into_primitive().tensor(), op)?;
    Ok(Tensor::from_primitive(TensorPrimitive::Float(reduced)))
}

/// The values of `values` reduced over the peers, in f64 (summed or averaged in f32).
pub(crate) fn all_reduce_values<B: Backend>(
    collective: &dyn Collective<B>,
    values: &[f64],
    op: Reduce,
    device: &B::Device,
) -> Result<Vec<f64>> {
    if values.is_empty() {
        return Ok(Vec::new());
    }
    let data: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    let tensor = Tensor::<B, 1>::from_data(TensorData::new(data, [values.len()]), device);
    let reduced = all_reduce_tensor(collective, tensor, op)?;
    let data = reduced.into_data().convert::<f32>();
    Ok(data
        .as_slice::<f32>()
        .map(|values| values.iter().map(|&v| v as f64).collect())
        .unwrap_or_default())
}

/// Whether `flag` holds on any peer (every peer gets the same answer).
pub(crate) fn agree_any<B: Backend>(
    collective: &dyn Collective<B>,
    flag: bool,
    device: &B::Device,
) -> Result<bool> {
    let votes = all_reduce_values(collective, &[flag as u8 as f64], Reduce::Sum, device)?;
    Ok(votes.first().is_some_and(|&v| v > 0.0))
}

/// Every float parameter of `module` replaced by peer 0's (a sum where the other peers add
/// zeros: exact). Every peer must call it.
pub(crate) fn broadcast_module<B: AutodiffBackend, M: AutodiffModule<B>>(
    collective: &dyn Collective<B::InnerBackend>,
    module: M,
) -> Result<M> {
    struct FromRankZero<'a, B: AutodiffBackend> {
        collective: &'a dyn Collective<B::InnerBackend>,
        error: Option<crate::Error>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for FromRankZero<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if self.error.is_some() {
                return param;
            }
            let collective = self.collective;
            let mut error = None;
            let param = param.map(|tensor| {
                let require_grad = tensor.is_require_grad();
                let inner = tensor.inner();
                let mine = if collective.rank() == 0 {
                    inner.clone()
                } else {
                    inner.zeros_like()
                };
                let dtype = inner.dtype();
                // Sums are taken in fp32 so that half parameters are copied exactly too.
                let sent = if dtype == DType::F32 {
                    mine
                } else {
                    mine.cast(DType::F32)
                };
                let value = match all_reduce_tensor(collective, sent, Reduce::Sum) {
                    Ok(sum) => sum.cast(dtype),
                    Err(e) => {
                        error = Some(e);
                        inner
                    }
                };
                let tensor = Tensor::<B, D>::from_inner(value);
                if require_grad {
                    tensor.require_grad()
                } else {
                    tensor
                }
            });
            self.error = error;
            param
        }
    }
    let mut mapper = FromRankZero::<B> {
        collective,
        error: None,
    };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(error) => Err(error),
        None => Ok(module),
    }
}

/// Gradients are all-reduced in buckets of about this many bytes: consecutive parameters'
/// gradients of one precision, flattened and joined, one call per bucket; the sums are the same,
/// element by element. PyTorch DDP's buckets hold 25 MB; here joining costs a copy of the bucket
/// and its reduced value beside the gradients, and on the CPU 25 MB buckets raised the peak of
/// two ResNet-18 peers from 276.8 to 343.9 MiB without a shorter step. 1 MiB joins the many small
/// tensors (norms, biases) into few calls and leaves the large ones alone.
pub(crate) const BUCKET_BYTES: usize = 1 << 20;

/// Averages the gradients of `model`'s parameters over the peers, in the model's order (the
/// same on every peer, unlike parameter ids), in buckets of `BUCKET_BYTES`. A parameter with a
/// gradient on some peers only (a branch one peer's data did not use) is averaged with zeros
/// from the others, in fp32; one without a gradient anywhere stays without.
pub fn all_reduce_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    collective: &dyn Collective<B::InnerBackend>,
    model: &M,
    grads: &mut GradientsParams,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Result<()> {
    all_reduce_grads_in_buckets::<B, M>(collective, model, grads, device, BUCKET_BYTES)
}

/// [`all_reduce_grads`] with buckets of `bucket_bytes` (at least one gradient each).
pub fn all_reduce_grads_in_buckets<B: AutodiffBackend, M: AutodiffModule<B>>(
    collective: &dyn Collective<B::InnerBackend>,
    model: &M,
    grads: &mut GradientsParams,
    device: &burn::tensor::Device<B::InnerBackend>,
    bucket_bytes: usize,
) -> Result<()> {
    // Which parameters have a gradient here, in the model's order.
    struct Present<'a> {
        grads: &'a GradientsParams,
        present: Vec<f64>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Present<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let here = self.grads.get::<B::InnerBackend, D>(param.id).is_some();
            self.present.push(here as u8 as f64);
        }
    }
    let mut present = Present {
        grads,
        present: Vec::new(),
    };
    model.visit(&mut present);
    let everywhere = all_reduce_values(collective, &present.present, Reduce::Sum, device)?;
    let world = collective.world_size() as f64;

    // The gradients to average, flattened, in the model's order (moved out, not copied).
    struct Take<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        everywhere: &'a [f64],
        world: f64,
        index: usize,
        flat: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let count = self.everywhere.get(self.index).copied().unwrap_or(0.0);
            self.index += 1;
            if count == 0.0 {
                return;
            }
            let grad = match self.grads.remove::<B::InnerBackend, D>(param.id) {
                Some(grad) if count >= self.world => grad,
                Some(grad) => grad.cast(DType::F32),
                None => {
                    let value = param.val().inner();
                    Tensor::<B::InnerBackend, D>::zeros(value.shape(), &value.device())
                }
            };
            let elements = grad.shape().num_elements();
            self.flat.push(grad.reshape([elements]));
        }
    }
    let mut take = Take::<B> {
        grads,
        everywhere: &everywhere,
        world,
        index: 0,
        flat: Vec::new(),
    };
    model.visit(&mut take);
    let flat = std::mem::take(&mut take.flat);

    // Averaged a bucket at a time.
    let mut averaged: Vec<Tensor<B::InnerBackend, 1>> = Vec::with_capacity(flat.len());
    let mut bucket: Vec<Tensor<B::InnerBackend, 1>> = Vec::new();
    let mut bytes = 0;
    let flush = |bucket: &mut Vec<Tensor<B::InnerBackend, 1>>,
                 averaged: &mut Vec<Tensor<B::InnerBackend, 1>>|
     -> Result<()> {
        match bucket.len() {
            0 => {}
            1 => averaged.push(all_reduce_tensor(
                collective,
                bucket.remove(0),
                Reduce::Mean,
            )?),
            _ => {
                let lengths: Vec<usize> = bucket.iter().map(|t| t.dims()[0]).collect();
                let joined = Tensor::cat(std::mem::take(bucket), 0);
                let mean = all_reduce_tensor(collective, joined, Reduce::Mean)?;
                let mut start = 0;
                for length in lengths {
                    averaged.push(mean.clone().slice([start..start + length]));
                    start += length;
                }
            }
        }
        Ok(())
    };
    for grad in flat {
        let size = grad.dims()[0] * grad.dtype().size();
        let same_dtype = bucket
            .first()
            .is_none_or(|first| first.dtype() == grad.dtype());
        if !bucket.is_empty() && (!same_dtype || bytes + size > bucket_bytes) {
            flush(&mut bucket, &mut averaged)?;
            bytes = 0;
        }
        bytes += size;
        bucket.push(grad);
    }
    flush(&mut bucket, &mut averaged)?;

    // Back in place, in the model's order.
    struct Put<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        everywhere: &'a [f64],
        index: usize,
        averaged: std::vec::IntoIter<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Put<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let count = self.everywhere.get(self.index).copied().unwrap_or(0.0);
            self.index += 1;
            if count == 0.0 {
                return;
            }
            if let Some(mean) = self.averaged.next() {
                let shape = param.lazy_shape();
                self.grads
                    .register::<B::InnerBackend, D>(param.id, mean.reshape(shape));
            }
        }
    }
    model.visit(&mut Put::<B> {
        grads,
        everywhere: &everywhere,
        index: 0,
        averaged: averaged.into_iter(),
    });
    Ok(())
}

/// The loss and its parts averaged over the peers, for the log.
pub(crate) fn mean_for_log<B: Backend>(
    collective: &dyn Collective<B>,
    values: &mut [f64],
    device: &B::Device,
) -> Result<()> {
    let mean = all_reduce_values(collective, values, Reduce::Mean, device)?;
    values.copy_from_slice(&mean);
    Ok(())
}
