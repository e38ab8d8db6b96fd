//! Two ops that keep for backward only a tensor which something else keeps anyway, and
//! recompute in backward what they would otherwise keep of their own:
//!
//! | op | keeps | recomputes in backward | where it saves |
//! |---|---|---|---|
//! | convolution, then normalisation | the convolution's input | the convolution's output (one convolution) | a ResNet's downsample: its input is the block's input, which the block's first convolution keeps |
//! | normalisation and activation, then max pooling | the normalisation's input | the activation's output and the maxima's indices (elementwise, one pooling) | a ResNet's stem: the indices (8 bytes per pooled element) are not kept |
//!
//! The recomputation gives the same bits as the forward, so gradients are those of the ops run
//! one after the other.

use std::fmt;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::prelude::{Backend, Tensor};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::TensorPrimitive;

use super::super::kernels::{Act, ConvKernels, Grouping, NormKernels, View, Wanted};
use super::conv::{node_key, register_weight_grad};
use super::fused::{ConvSpec, NormSpec};
use super::norm::inv_std;
use super::Normalised;

/// Max pooling's options.
#[derive(Clone, Debug)]
pub(crate) struct PoolSpec {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub ceil_mode: bool,
}

/// The normalisation's constants for backward.
#[derive(Clone)]
struct NormState<K: Backend> {
    mean: FloatTensor<K>,
    invstd: FloatTensor<K>,
    gamma: FloatTensor<K>,
    beta: FloatTensor<K>,
    view: View,
    grouping: Grouping,
    act: Act,
    batch: bool,
}

impl<K: NormKernels> NormState<K> {
    /// The statistics of `x` (or the given running ones): the state, the normalisation's
    /// output, and the variance (for the running statistics).
    fn forward(
        x: FloatTensor<K>,
        norm: NormSpec<Autodiff<K>>,
    ) -> (Self, FloatTensor<K>, FloatTensor<K>) {
        let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
        let (mean, var, batch) = norm.statistics.inner().of(&x, norm.view, norm.grouping);
        let state = NormState {
            invstd: inv_std::<K>(var.clone(), norm.epsilon),
            mean,
            gamma: inner(norm.gamma),
            beta: inner(norm.beta),
            view: norm.view,
            grouping: norm.grouping,
            act: norm.act,
            batch,
        };
        let output = state.apply(x);
        (state, output, var)
    }

    fn apply(&self, x: FloatTensor<K>) -> FloatTensor<K> {
        K::norm_apply(
            x,
            self.view,
            self.grouping,
            &self.mean,
            &self.invstd,
            &self.gamma,
            &self.beta,
            self.act,
        )
    }

    /// `(dx, dgamma, dbeta)` for the activation's output gradient `dy`.
    fn backward(
        &self,
        x: &FloatTensor<K>,
        dy: FloatTensor<K>,
        input: bool,
        affine: bool,
    ) -> [Option<FloatTensor<K>>; 3] {
        let wanted = Wanted {
            input,
            affine,
            batch_stats: self.batch,
        };
        let (dx, dgamma, dbeta) = K::norm_backward(
            x,
            dy,
            self.view,
            self.grouping,
            &self.mean,
            &self.invstd,
            &self.gamma,
            &self.beta,
            self.act,
            wanted,
        );
        [dx, dgamma, dbeta]
    }
}

/// The batch statistics to hand back for the running averages, when the forward took them.
fn batch_stats<K: Backend>(
    state: &NormState<K>,
    var: FloatTensor<K>,
) -> Option<(FloatTensor<Autodiff<K>>, FloatTensor<Autodiff<K>>)> {
    state.batch.then(|| {
        (
            Autodiff::<K>::from_inner(state.mean.clone()),
            Autodiff::<K>::from_inner(var),
        )
    })
}

/// The bias, or an untracked leaf standing in for a missing one (no gradient goes there).
fn bias_or_stand_in<K: Backend>(
    bias: &Option<FloatTensor<Autodiff<K>>>,
    weight: &FloatTensor<K>,
) -> FloatTensor<Autodiff<K>> {
    match bias {
        Some(bias) => bias.clone(),
        None => Autodiff::<K>::from_inner(super::super::kernels::generic::scalar_like::<K>(weight)),
    }
}

/// The bias gradient of a convolution: `dy` summed over all but the channels.
fn bias_grad<K: Backend>(dy: &FloatTensor<K>) -> FloatTensor<K> {
    let dy = Tensor::<K, 4>::from_primitive(TensorPrimitive::Float(dy.clone()));
    let channels = dy.dims()[1];
    dy.sum_dim(0)
        .sum_dim(2)
        .sum_dim(3)
        .reshape([channels])
        .into_primitive()
        .tensor()
}

// ---------------------------------------------------------------------------------------------
// Convolution, then normalisation.

pub(super) fn tracked_conv_norm<K: NormKernels + ConvKernels>(
    x: FloatTensor<Autodiff<K>>,
    conv: ConvSpec<Autodiff<K>>,
    norm: NormSpec<Autodiff<K>>,
) -> Normalised<Autodiff<K>> {
    let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
    let (xi, wi) = (inner(x.clone()), inner(conv.weight.clone()));
    let bias = conv.bias.clone().map(inner);
    let conv_out = K::conv2d_forward(xi.clone(), wi.clone(), bias.clone(), conv.options.clone());
    let nodes = [
        x.node.clone(),
        conv.weight.node.clone(),
        bias_or_stand_in::<K>(&conv.bias, &wi).node,
        norm.gamma.node.clone(),
        norm.beta.node.clone(),
    ];
    let (state, output, var) = NormState::<K>::forward(conv_out, norm);
    let batch_stats = batch_stats(&state, var);
    let output = match ConvNormBackward
        .prepare::<NoCheckpointing>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            ConvNormState {
                x: xi,
                weight: wi,
                bias,
                options: conv.options,
                norm: state,
            },
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Normalised {
        output,
        batch_stats,
    }
}

#[derive(Clone)]
struct ConvNormState<K: Backend> {
    x: FloatTensor<K>,
    weight: FloatTensor<K>,
    bias: Option<FloatTensor<K>>,
    options: ConvOptions<2>,
    norm: NormState<K>,
}

impl<K: Backend> fmt::Debug for ConvNormState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConvNorm({:?}, {:?})", self.options, self.norm.act)
    }
}

#[derive(Debug)]
struct ConvNormBackward;

impl<K: NormKernels + ConvKernels> Backward<K, 5> for ConvNormBackward {
    type State = ConvNormState<K>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pbias, pg, pb] = ops.parents;
        let dy = grads.consume::<K>(&ops.node);
        let s = ops.state;
        let wants_conv = px.is_some() || pw.is_some() || pbias.is_some();
        // The convolution's output, recomputed: the normalisation's saved input.
        let conv_out = K::conv2d_forward(
            s.x.clone(),
            s.weight.clone(),
            s.bias.clone(),
            s.options.clone(),
        );
        let [dconv, dgamma, dbeta] =
            s.norm
                .backward(&conv_out, dy, wants_conv, pg.is_some() || pb.is_some());
        drop(conv_out);
        for (parent, grad) in [(pg, dgamma), (pb, dbeta)] {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<K>(node.id, grad);
            }
        }
        let Some(dconv) = dconv else { return };
        if let Some(node) = pbias {
            grads.register::<K>(node.id, bias_grad::<K>(&dconv));
        }
        if let Some(node) = px {
            let dx = K::conv2d_input_grad(
                s.x.clone(),
                s.weight.clone(),
                dconv.clone(),
                s.options.clone(),
            );
            grads.register::<K>(node.id, dx);
        }
        if let Some(node) = pw {
            let mut key = node_key::<K>(&s.weight);
            key.node = node;
            register_weight_grad::<K>(grads, key, s.x, s.weight, dconv, s.options);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Normalisation and activation, then max pooling.

pub(super) fn tracked_norm_act_pool<K: NormKernels>(
    x: FloatTensor<Autodiff<K>>,
    norm: NormSpec<Autodiff<K>>,
    pool: PoolSpec,
) -> Normalised<Autodiff<K>> {
    let xi = Autodiff::<K>::inner(x.clone());
    let nodes = [
        x.node.clone(),
        norm.gamma.node.clone(),
        norm.beta.node.clone(),
    ];
    let (state, activated, var) = NormState::<K>::forward(xi.clone(), norm);
    let batch_stats = batch_stats(&state, var);
    let output = K::max_pool2d(
        activated,
        pool.kernel,
        pool.stride,
        pool.padding,
        pool.dilation,
        pool.ceil_mode,
    );
    let output = match NormPoolBackward
        .prepare::<NoCheckpointing>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            NormPoolState {
                x: xi,
                pool,
                norm: state,
            },
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Normalised {
        output,
        batch_stats,
    }
}

#[derive(Clone)]
struct NormPoolState<K: Backend> {
    x: FloatTensor<K>,
    pool: PoolSpec,
    norm: NormState<K>,
}

impl<K: Backend> fmt::Debug for NormPoolState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NormActPool({:?}, {:?})", self.norm.act, self.pool)
    }
}

#[derive(Debug)]
struct NormPoolBackward;

impl<K: NormKernels> Backward<K, 3> for NormPoolBackward {
    type State = NormPoolState<K>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pg, pb] = ops.parents;
        let dz = grads.consume::<K>(&ops.node);
        if px.is_none() && pg.is_none() && pb.is_none() {
            return;
        }
        let s = ops.state;
        let p = &s.pool;
        // The activation's output and the maxima's indices, recomputed: the same bits as in
        // the forward, so the same maxima are chosen.
        let activated = s.norm.apply(s.x.clone());
        let indices = K::max_pool2d_with_indices(
            activated.clone(),
            p.kernel,
            p.stride,
            p.padding,
            p.dilation,
            p.ceil_mode,
        )
        .indices;
        let dy = K::max_pool2d_with_indices_backward(
            activated,
            p.kernel,
            p.stride,
            p.padding,
            p.dilation,
            p.ceil_mode,
            dz,
            indices,
        )
        .x_grad;
        let [dx, dgamma, dbeta] =
            s.norm
                .backward(&s.x, dy, px.is_some(), pg.is_some() || pb.is_some());
        for (parent, grad) in [(px, dx), (pg, dgamma), (pb, dbeta)] {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<K>(node.id, grad);
            }
        }
    }
}
