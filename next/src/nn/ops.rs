//! The autodiff operations under memsave's lean layers on Burn 0.22: a normalisation (LayerNorm,
//! GroupNorm, BatchNorm's statistics, optionally with its ReLU) and a ReLU, each one node of
//! Burn's graph with a hand-written backward that keeps only what it needs.
//!
//! | op | keeps for backward | Burn 0.22 keeps |
//! |---|---|---|
//! | normalisation (+ ReLU) | its input, fp32 mean and 1/std per group | LayerNorm, GroupNorm: an activation-sized tensor beside the input (`next/tests/nn.rs`: 8,465,084 and 8,403,580 bytes for an 8 MiB input, ours 69,888 and 7,616); BatchNorm (`batch_norm_train`, one op already): its input and the statistics, and its ReLU's input besides |
//! | ReLU | its output (which its consumer keeps anyway) | its input (alive beside the output: 256 KiB more for a 256 KiB input) |
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
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, GradientCheckpointingStrategy};

use super::math;
use super::view::{Act, Grouping, View, Wanted};
use crate::backend::{is_tracked, on_backend, AdTensor, DispatchBackend, OnBackend};
use crate::checkpoint::nodes::node;

/// A plain tensor of `B` as a dispatch tensor.
fn plain<B: DispatchBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<D> {
    Tensor::from_dispatch(B::from_plain(t))
}

/// A dispatch tensor's plain primitive on `B` (its autodiff wrapper, if any, dropped).
fn inner<B: DispatchBackend, const D: usize>(t: Tensor<D>) -> FloatTensor<B> {
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
fn untracked_stats<B: DispatchBackend>(
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
    fn of<B: DispatchBackend, const D: usize>(
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
fn composed<const D: usize>(
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
struct NormState<B: DispatchBackend> {
    x: FloatTensor<B>,
    mean: FloatTensor<B>,
    invstd: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    norm: Norm,
    batch: bool,
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

/// The convolution after a normalisation and its ReLU: its weight, bias and options.
#[derive(Clone, Debug)]
pub(crate) struct Conv {
    pub(crate) weight: Tensor<4>,
    pub(crate) bias: Option<Tensor<1>>,
    pub(crate) options: ConvOptions<2>,
}

/// `conv(relu(norm(x)))` as one node that keeps only `x` (and the statistics): the ReLU's
/// output, which the convolution would keep for its weight gradient, is recomputed from `x` in
/// backward (In-Place Activated BatchNorm's saving, exact for a ReLU). The convolution's
/// forward and gradients are the backend's own (`conv2d`, `conv2d_x_backward`,
/// `conv2d_weight_backward`, `conv2d_bias_backward`).
pub(crate) fn normalise_relu_conv(
    x: Tensor<4>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    statistics: Statistics,
    norm: Norm,
    conv: Conv,
) -> Normalised<4> {
    let norm = Norm {
        act: Act::Relu,
        ..norm
    };
    let tracked = [&x.clone().into_dispatch(), &gamma.clone().into_dispatch()]
        .into_iter()
        .chain([
            &beta.clone().into_dispatch(),
            &conv.weight.clone().into_dispatch(),
        ])
        .any(is_tracked)
        || conv
            .bias
            .as_ref()
            .is_some_and(|bias| is_tracked(&bias.clone().into_dispatch()));
    if tracked {
        let op = NormConvOp {
            x: x.clone(),
            gamma: gamma.clone(),
            beta: beta.clone(),
            statistics: statistics.clone(),
            norm,
            conv: conv.clone(),
        };
        if let Ok(Some(out)) = on_backend(&x.clone().into_dispatch(), op) {
            return out;
        }
    }
    let normalised = composed(x, gamma, beta, statistics, norm);
    Normalised {
        output: burn::tensor::module::conv2d(
            normalised.output,
            conv.weight,
            conv.bias,
            conv.options,
        ),
        batch_stats: normalised.batch_stats,
    }
}

struct NormConvOp {
    x: Tensor<4>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    statistics: Statistics,
    norm: Norm,
    conv: Conv,
}

impl OnBackend for NormConvOp {
    type Output = Option<Normalised<4>>;

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

impl NormConvOp {
    fn tracked<B: DispatchBackend, C: CheckpointStrategy>(
        self,
        strategy: GradientCheckpointingStrategy,
    ) -> Normalised<4> {
        let NormConvOp {
            x,
            gamma,
            beta,
            statistics,
            norm,
            conv,
        } = self;
        let xa = B::autodiff_of(x.into_dispatch());
        let ga = B::autodiff_of(gamma.into_dispatch());
        let ba = B::autodiff_of(beta.into_dispatch());
        let wa = B::autodiff_of(conv.weight.into_dispatch());
        let bias = conv.bias.map(|bias| B::autodiff_of(bias.into_dispatch()));
        let xi = xa.primitive().clone();
        let xp = plain::<B, 4>(xi.clone());
        let (mean, var, batch) = statistics.of::<B, 4>(&xp, norm);
        let invstd = math::inv_std(var.clone(), norm.epsilon);
        let (gi, bi, wi) = (
            ga.primitive().clone(),
            ba.primitive().clone(),
            wa.primitive().clone(),
        );
        let z = math::apply(
            xp,
            norm.view,
            norm.grouping,
            &mean,
            &invstd,
            &plain::<B, 1>(gi.clone()),
            &plain::<B, 1>(bi.clone()),
            Act::Relu,
        );
        let output = B::conv2d(
            inner::<B, 4>(z),
            wi.clone(),
            bias.as_ref().map(|bias| bias.primitive().clone()),
            conv.options.clone(),
        );
        // No bias: an untracked placeholder parent, which gets no gradient.
        let bias = bias.unwrap_or_else(|| AdTensor::<B>::new(scalar_like::<B>(&gi)));
        let state = NormConvState::<B> {
            norm: NormState {
                x: xi,
                mean: inner::<B, 1>(mean.clone()),
                invstd: inner::<B, 1>(invstd),
                gamma: gi,
                beta: bi,
                norm,
                batch,
            },
            weight: wi,
            bias: bias.primitive().clone(),
            options: conv.options,
        };
        let output =
            node::<B, C, _, 5>(NormConvBackward, [&xa, &ga, &ba, &wa, &bias], state, output);
        Normalised {
            output: Tensor::from_dispatch(B::from_autodiff(output, strategy)),
            batch_stats: batch.then(|| untracked_stats::<B>(mean, var, strategy)),
        }
    }
}

/// A one-element fp32 zero on the device of `like`.
fn scalar_like<B: DispatchBackend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    use burn::backend::TensorMetadata;
    B::float_zeros(
        burn::tensor::Shape::new([1]),
        &like.device(),
        burn::tensor::FloatDType::F32,
    )
}

#[derive(Clone)]
struct NormConvState<B: DispatchBackend> {
    norm: NormState<B>,
    weight: FloatTensor<B>,
    bias: FloatTensor<B>,
    options: ConvOptions<2>,
}

impl<B: DispatchBackend> fmt::Debug for NormConvState<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NormConvState({:?}, {:?})", self.norm, self.options)
    }
}

#[derive(Debug)]
struct NormConvBackward;

impl<B: DispatchBackend> Backward<B, 5> for NormConvBackward {
    type State = NormConvState<B>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pg, pb, pw, pbias] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let n = s.norm;
        let x = plain::<B, 4>(n.x);
        let (mean, invstd) = (plain::<B, 1>(n.mean), plain::<B, 1>(n.invstd));
        let (gamma, beta) = (plain::<B, 1>(n.gamma), plain::<B, 1>(n.beta));
        // The ReLU's output, recomputed from the input (the forward kept only the input).
        let z = inner::<B, 4>(math::apply(
            x.clone(),
            n.norm.view,
            n.norm.grouping,
            &mean,
            &invstd,
            &gamma,
            &beta,
            Act::Relu,
        ));
        if let Some(node) = pw {
            let dw = B::conv2d_weight_backward(
                z.clone(),
                s.weight.clone(),
                dy.clone(),
                s.options.clone(),
            );
            grads.register::<B>(node.id, dw);
        }
        if let Some(node) = pbias {
            let db = B::conv2d_bias_backward(z.clone(), s.bias, dy.clone());
            grads.register::<B>(node.id, db);
        }
        let wanted = Wanted {
            input: px.is_some(),
            affine: pg.is_some() || pb.is_some(),
            batch_stats: n.batch,
        };
        if !(wanted.input || wanted.affine) {
            return;
        }
        let dz = B::conv2d_x_backward(z, s.weight, dy, s.options);
        let (dx, dgamma, dbeta) = math::backward(
            &x,
            plain::<B, 4>(dz),
            n.norm.view,
            n.norm.grouping,
            &mean,
            &invstd,
            &gamma,
            &beta,
            Act::Relu,
            wanted,
        );
        let affine_dtype = gamma.dtype();
        if let (Some(node), Some(dx)) = (px, dx) {
            grads.register::<B>(node.id, inner::<B, 4>(dx));
        }
        if let (Some(node), Some(dgamma)) = (pg, dgamma) {
            grads.register::<B>(node.id, inner::<B, 1>(dgamma.cast(affine_dtype)));
        }
        if let (Some(node), Some(dbeta)) = (pb, dbeta) {
            grads.register::<B>(node.id, inner::<B, 1>(dbeta.cast(affine_dtype)));
        }
    }
}
