//! `conv(relu(norm(x)))` as one node of Burn's graph that keeps only `x` and the statistics
//! (BatchNorm's `forward_relu_conv`).

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
use burn::tensor::GradientCheckpointingStrategy;

use super::math;
use super::ops::{
    composed, inner, plain, untracked_stats, Norm, NormState, Normalised, Statistics,
};
use super::view::{Act, Wanted};
use crate::backend::{is_tracked, on_backend, AdTensor, DispatchBackend, OnBackend};
use crate::checkpoint::nodes::node;

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
