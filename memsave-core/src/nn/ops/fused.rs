//! A normalisation, its activation and the convolution after them as one op that keeps only
//! the normalisation's input: the activation's output, which a convolution would keep for its
//! weight gradient, is recomputed from it in backward (an elementwise pass) instead.
//!
//! This is In-Place Activated BatchNorm's saving (Rota Bulò et al., CVPR 2018: one
//! activation-sized tensor per conv-BN-activation instead of two) made exact for any
//! activation. In-Place ABN keeps the activation's *output* and inverts the activation to
//! recover the BN input, which a ReLU does not allow (its negative half is lost, and BN's
//! backward needs it there); keeping the *input* and recomputing the output needs no inverse.

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
use super::norm::inv_std;
use super::{Normalised, Statistics};

/// The normalisation's parameters and how it groups.
pub(crate) struct NormSpec<B: Backend> {
    pub gamma: FloatTensor<B>,
    pub beta: FloatTensor<B>,
    pub statistics: Statistics<B>,
    pub view: View,
    pub grouping: Grouping,
    pub act: Act,
    pub epsilon: f64,
}

/// The convolution's parameters.
pub(crate) struct ConvSpec<B: Backend> {
    pub weight: FloatTensor<B>,
    pub bias: Option<FloatTensor<B>>,
    pub options: ConvOptions<2>,
}

pub(super) fn tracked_norm_act_conv<K: NormKernels + ConvKernels>(
    x: FloatTensor<Autodiff<K>>,
    norm: NormSpec<Autodiff<K>>,
    conv: ConvSpec<Autodiff<K>>,
) -> Normalised<Autodiff<K>> {
    let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
    let (xi, gi, bi, wi) = (
        inner(x.clone()),
        inner(norm.gamma.clone()),
        inner(norm.beta.clone()),
        inner(conv.weight.clone()),
    );
    let (mean, var, batch) = norm.statistics.inner().of(&xi, norm.view, norm.grouping);
    let invstd = inv_std::<K>(var.clone(), norm.epsilon);
    let activated = K::norm_apply(
        xi.clone(),
        norm.view,
        norm.grouping,
        &mean,
        &invstd,
        &gi,
        &bi,
        norm.act,
    );
    let output = K::conv2d_forward(
        activated,
        wi.clone(),
        conv.bias.clone().map(inner),
        conv.options.clone(),
    );
    let bias_node = match &conv.bias {
        Some(bias) => bias.node.clone(),
        None => {
            Autodiff::<K>::from_inner(super::super::kernels::generic::scalar_like::<K>(&wi)).node
        }
    };
    let nodes = [
        x.node.clone(),
        norm.gamma.node.clone(),
        norm.beta.node.clone(),
        conv.weight.node.clone(),
        bias_node,
    ];
    let output = match FusedBackward
        .prepare::<NoCheckpointing>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            FusedState {
                x: xi,
                mean: mean.clone(),
                invstd,
                gamma: gi,
                beta: bi,
                weight: wi,
                options: conv.options,
                view: norm.view,
                grouping: norm.grouping,
                act: norm.act,
                batch,
            },
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    let from_inner = |t: FloatTensor<K>| Autodiff::<K>::from_inner(t);
    Normalised {
        output,
        batch_stats: batch.then(|| (from_inner(mean), from_inner(var))),
    }
}

#[derive(Clone)]
struct FusedState<K: Backend> {
    x: FloatTensor<K>,
    mean: FloatTensor<K>,
    invstd: FloatTensor<K>,
    gamma: FloatTensor<K>,
    beta: FloatTensor<K>,
    weight: FloatTensor<K>,
    options: ConvOptions<2>,
    view: View,
    grouping: Grouping,
    act: Act,
    batch: bool,
}

impl<K: Backend> fmt::Debug for FusedState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NormActConv({:?}, {:?})", self.act, self.options)
    }
}

#[derive(Debug)]
struct FusedBackward;

impl<K: NormKernels + ConvKernels> Backward<K, 5> for FusedBackward {
    type State = FusedState<K>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pg, pb, pw, pbias] = ops.parents;
        let dz = grads.consume::<K>(&ops.node);
        let s = ops.state;
        if let Some(node) = pbias {
            let dz = Tensor::<K, 4>::from_primitive(TensorPrimitive::Float(dz.clone()));
            let channels = dz.dims()[1];
            let db = dz.sum_dim(0).sum_dim(2).sum_dim(3).reshape([channels]);
            grads.register::<K>(node.id, db.into_primitive().tensor());
        }
        // The activation's output, recomputed from the input: the convolution's saved input.
        let activated = K::norm_apply(
            s.x.clone(),
            s.view,
            s.grouping,
            &s.mean,
            &s.invstd,
            &s.gamma,
            &s.beta,
            s.act,
        );
        let wants_norm = px.is_some() || pg.is_some() || pb.is_some();
        let dy = wants_norm.then(|| {
            K::conv2d_input_grad(
                activated.clone(),
                s.weight.clone(),
                dz.clone(),
                s.options.clone(),
            )
        });
        if let Some(node) = pw {
            let mut key = node_key::<K>(&s.weight);
            key.node = node;
            register_weight_grad::<K>(grads, key, activated, s.weight, dz, s.options);
        }
        let Some(dy) = dy else { return };
        let wanted = Wanted {
            input: px.is_some(),
            affine: pg.is_some() || pb.is_some(),
            batch_stats: s.batch,
        };
        let (dx, dgamma, dbeta) = K::norm_backward(
            &s.x, dy, s.view, s.grouping, &s.mean, &s.invstd, &s.gamma, &s.beta, s.act, wanted,
        );
        for (parent, grad) in [(px, dx), (pg, dgamma), (pb, dbeta)] {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<K>(node.id, grad);
            }
        }
    }
}
