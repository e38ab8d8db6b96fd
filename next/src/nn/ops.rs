//! The autodiff operations under memsave's lean layers on Burn 0.22: a normalisation (LayerNorm,
//! GroupNorm, BatchNorm's statistics, optionally with its ReLU) and a ReLU, each one node of
//! Burn's graph with a hand-written backward that keeps only what it needs.
//!
//! | op | keeps for backward | Burn 0.22 keeps |
//! |---|---|---|
//! | normalisation (+ ReLU) | its input, fp32 mean and 1/std per group | LayerNorm, GroupNorm: an activation-sized tensor beside the input (`next/tests/suite/nn.rs`: 8,465,084 and 8,403,580 bytes for an 8 MiB input, ours 69,888 and 7,616); BatchNorm (`batch_norm_train`, one op already): its input and the statistics, and its ReLU's input besides |
//! | ReLU | its output (which its consumer keeps anyway) | its input (alive beside the output: 256 KiB more for a 256 KiB input) |
//! | BatchNorm + ReLU + convolution ([`super::fused`]) | the BatchNorm's input and statistics | the ReLU's output besides (the convolution's input) |
//!
//! The ops run on `Autodiff<B, C>` for every backend memsave dispatches to
//! ([`crate::backend::on_backend`]: Flex) under either of Burn's checkpointing strategies `C`;
//! the arithmetic is tensor ops on the plain tensors ([`super::math`]). An untracked input runs
//! the same arithmetic without a node; a tensor on another backend runs it as Burn's composed
//! ops (Burn differentiates them).

use std::fmt;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::prelude::*;
use burn::tensor::{DType, GradientCheckpointingStrategy};

use super::math;
use super::view::{Act, Grouping, View, Wanted};
use crate::backend::{is_tracked, on_backend, AdTensor, DispatchBackend, OnBackend};
use crate::checkpoint::nodes::node;

/// A plain tensor of `B` as a dispatch tensor.
pub(super) fn plain<B: DispatchBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<D> {
    Tensor::from_dispatch(B::from_plain(t))
}

/// A dispatch tensor's plain primitive on `B` (its autodiff wrapper, if any, dropped).
pub(super) fn inner<B: DispatchBackend, const D: usize>(t: Tensor<D>) -> FloatTensor<B> {
    B::plain_of(t.into_dispatch())
}

/// A plain primitive as an untracked tensor on the autodiff device of `strategy`.
fn untracked<B: DispatchBackend, const D: usize>(
    t: FloatTensor<B>,
    strategy: GradientCheckpointingStrategy,
) -> Tensor<D> {
    Tensor::from_dispatch(B::from_autodiff(AdTensor::<B>::new(t), strategy))
}

/// The batch statistics, plain, as untracked tensors on the autodiff device of `strategy`.
pub(super) fn untracked_stats<B: DispatchBackend>(
    mean: Tensor<1>,
    var: Tensor<1>,
    strategy: GradientCheckpointingStrategy,
) -> (Tensor<1>, Tensor<1>) {
    (
        untracked::<B, 1>(inner::<B, 1>(mean), strategy),
        untracked::<B, 1>(inner::<B, 1>(var), strategy),
    )
}

/// The statistics a normalisation uses.
#[derive(Clone, Debug)]
pub(crate) enum Statistics {
    /// Those of this input (training BatchNorm, GroupNorm, LayerNorm).
    Batch,
    /// Given ones, constants (BatchNorm in eval mode): mean and biased variance, `[groups]`.
    Running { mean: Tensor<1>, var: Tensor<1> },
}

impl Statistics {
    /// The mean and variance to normalise the plain tensor `x` with (fp32, plain), and whether
    /// they are its own (training).
    pub(super) fn of<B: DispatchBackend, const D: usize>(
        self,
        x: &Tensor<D>,
        norm: Norm,
    ) -> (Tensor<1>, Tensor<1>, bool) {
        match self {
            Statistics::Batch => {
                let (mean, var) = math::stats(x, norm.view, norm.grouping);
                (mean, var, true)
            }
            Statistics::Running { mean, var } => (
                plain::<B, 1>(inner::<B, 1>(mean)).cast(DType::F32),
                plain::<B, 1>(inner::<B, 1>(var)).cast(DType::F32),
                false,
            ),
        }
    }
}

/// A normalisation's output, and the batch statistics where it computed them (fp32,
/// untracked, on the input's device: for running averages).
pub(crate) struct Normalised<const D: usize> {
    pub(crate) output: Tensor<D>,
    pub(crate) batch_stats: Option<(Tensor<1>, Tensor<1>)>,
}

/// The normalisation's settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Norm {
    pub(crate) view: View,
    pub(crate) grouping: Grouping,
    pub(crate) act: Act,
    pub(crate) epsilon: f64,
}

/// `act((x - mean) / sqrt(var + eps) * gamma + beta)`, statistics per group of `grouping` over
/// `view`, in fp32 whatever `x`'s float type, the output in `x`'s type: one node keeping `x`
/// and two fp32 numbers per group where anything is tracked.
pub(crate) fn normalise<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    statistics: Statistics,
    norm: Norm,
) -> Normalised<D> {
    let tracked = is_tracked(&x.clone().into_dispatch())
        || is_tracked(&gamma.clone().into_dispatch())
        || is_tracked(&beta.clone().into_dispatch());
    if tracked {
        let op = NormOp {
            x: x.clone(),
            gamma: gamma.clone(),
            beta: beta.clone(),
            statistics: statistics.clone(),
            norm,
        };
        if let Ok(Some(out)) = on_backend(&x.clone().into_dispatch(), op) {
            return out;
        }
    }
    // Nothing tracked (no node to keep anything), or a backend without memsave's ops (Burn
    // differentiates the tensor ops).
    composed(x, gamma, beta, statistics, norm)
}

/// The normalisation as tensor ops.
pub(super) fn composed<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    statistics: Statistics,
    norm: Norm,
) -> Normalised<D> {
    let (mean, var, batch) = match statistics {
        Statistics::Batch => {
            let (mean, var) = math::stats(&x, norm.view, norm.grouping);
            (mean, var, true)
        }
        Statistics::Running { mean, var } => (mean.cast(DType::F32), var.cast(DType::F32), false),
    };
    let invstd = math::inv_std(var.clone(), norm.epsilon);
    let output = math::apply(
        x,
        norm.view,
        norm.grouping,
        &mean,
        &invstd,
        &gamma,
        &beta,
        norm.act,
    );
    Normalised {
        output,
        batch_stats: batch.then(|| (mean.detach(), var.detach())),
    }
}

struct NormOp<const D: usize> {
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    statistics: Statistics,
    norm: Norm,
}

impl<const D: usize> OnBackend for NormOp<D> {
    /// `None` where the input is not on an autodiff device.
    type Output = Option<Normalised<D>>;

    fn run<B: DispatchBackend>(
        self,
        strategy: Option<GradientCheckpointingStrategy>,
    ) -> Self::Output {
        let strategy = strategy?;
        Some(match strategy {
            GradientCheckpointingStrategy::Balanced => {
                self.tracked::<B, BalancedCheckpointing>(strategy)
            }
            GradientCheckpointingStrategy::Disabled => self.tracked::<B, NoCheckpointing>(strategy),
        })
    }
}

impl<const D: usize> NormOp<D> {
    fn tracked<B: DispatchBackend, C: CheckpointStrategy>(
        self,
        strategy: GradientCheckpointingStrategy,
    ) -> Normalised<D> {
        let NormOp {
            x,
            gamma,
            beta,
            statistics,
            norm,
        } = self;
        let xa = B::autodiff_of(x.into_dispatch());
        let ga = B::autodiff_of(gamma.into_dispatch());
        let ba = B::autodiff_of(beta.into_dispatch());
        let (xi, gi, bi) = (
            xa.primitive().clone(),
            ga.primitive().clone(),
            ba.primitive().clone(),
        );
        let xp = plain::<B, D>(xi.clone());
        let (mean, var, batch) = statistics.of::<B, D>(&xp, norm);
        let invstd = math::inv_std(var.clone(), norm.epsilon);
        let output = math::apply(
            xp,
            norm.view,
            norm.grouping,
            &mean,
            &invstd,
            &plain::<B, 1>(gi.clone()),
            &plain::<B, 1>(bi.clone()),
            norm.act,
        );
        let state = NormState::<B> {
            x: xi,
            mean: inner::<B, 1>(mean.clone()),
            invstd: inner::<B, 1>(invstd),
            gamma: gi,
            beta: bi,
            norm,
            batch,
        };
        let output = node::<B, C, _, 3>(
            NormBackward::<D>,
            [&xa, &ga, &ba],
            state,
            inner::<B, D>(output),
        );
        Normalised {
            output: Tensor::from_dispatch(B::from_autodiff(output, strategy)),
            batch_stats: batch.then(|| untracked_stats::<B>(mean, var, strategy)),
        }
    }
}

#[derive(Clone)]
pub(super) struct NormState<B: DispatchBackend> {
    pub(super) x: FloatTensor<B>,
    pub(super) mean: FloatTensor<B>,
    pub(super) invstd: FloatTensor<B>,
    pub(super) gamma: FloatTensor<B>,
    pub(super) beta: FloatTensor<B>,
    pub(super) norm: Norm,
    pub(super) batch: bool,
}

impl<B: DispatchBackend> fmt::Debug for NormState<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NormState({:?}, batch: {})", self.norm, self.batch)
    }
}

#[derive(Debug)]
struct NormBackward<const D: usize>;

impl<B: DispatchBackend, const D: usize> Backward<B, 3> for NormBackward<D> {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pg, pb] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let wanted = Wanted {
            input: px.is_some(),
            affine: pg.is_some() || pb.is_some(),
            batch_stats: s.batch,
        };
        let gamma = plain::<B, 1>(s.gamma);
        let (dx, dgamma, dbeta) = math::backward(
            &plain::<B, D>(s.x),
            plain::<B, D>(dy),
            s.norm.view,
            s.norm.grouping,
            &plain::<B, 1>(s.mean),
            &plain::<B, 1>(s.invstd),
            &gamma,
            &plain::<B, 1>(s.beta),
            s.norm.act,
            wanted,
        );
        let affine_dtype = gamma.dtype();
        if let (Some(node), Some(dx)) = (px, dx) {
            grads.register::<B>(node.id, inner::<B, D>(dx));
        }
        if let (Some(node), Some(dgamma)) = (pg, dgamma) {
            grads.register::<B>(node.id, inner::<B, 1>(dgamma.cast(affine_dtype)));
        }
        if let (Some(node), Some(dbeta)) = (pb, dbeta) {
            grads.register::<B>(node.id, inner::<B, 1>(dbeta.cast(affine_dtype)));
        }
    }
}

/// A ReLU that keeps its output for backward (Burn's keeps its input): the output is what the
/// next layer keeps anyway, so the ReLU itself costs no memory.
pub fn relu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if is_tracked(&x.clone().into_dispatch()) {
        if let Ok(Some(out)) = on_backend(&x.clone().into_dispatch(), ReluOp(x.clone())) {
            return out;
        }
    }
    burn::tensor::activation::relu(x)
}

struct ReluOp<const D: usize>(Tensor<D>);

impl<const D: usize> OnBackend for ReluOp<D> {
    type Output = Option<Tensor<D>>;

    fn run<B: DispatchBackend>(
        self,
        strategy: Option<GradientCheckpointingStrategy>,
    ) -> Self::Output {
        let strategy = strategy?;
        let out = match strategy {
            GradientCheckpointingStrategy::Balanced => {
                relu_tracked::<B, BalancedCheckpointing, D>(self.0)
            }
            GradientCheckpointingStrategy::Disabled => {
                relu_tracked::<B, NoCheckpointing, D>(self.0)
            }
        };
        Some(Tensor::from_dispatch(B::from_autodiff(out, strategy)))
    }
}

fn relu_tracked<B: DispatchBackend, C: CheckpointStrategy, const D: usize>(
    x: Tensor<D>,
) -> AdTensor<B> {
    let xa = B::autodiff_of(x.into_dispatch());
    let y = inner::<B, D>(burn::tensor::activation::relu(plain::<B, D>(
        xa.primitive().clone(),
    )));
    node::<B, C, _, 1>(ReluBackward::<D>, [&xa], Kept(y.clone()), y)
}

/// The ReLU's output, kept for its backward.
#[derive(Clone)]
struct Kept<B: DispatchBackend>(FloatTensor<B>);

impl<B: DispatchBackend> fmt::Debug for Kept<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Kept")
    }
}

#[derive(Debug)]
struct ReluBackward<const D: usize>;

impl<B: DispatchBackend, const D: usize> Backward<B, 1> for ReluBackward<D> {
    type State = Kept<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let Some(node) = px else {
            return;
        };
        let y = plain::<B, D>(ops.state.0);
        let dx = plain::<B, D>(dy).mask_fill(y.lower_equal_elem(0.0), 0.0);
        grads.register::<B>(node.id, inner::<B, D>(dx));
    }
}
