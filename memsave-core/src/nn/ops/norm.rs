//! The normalisation op: statistics, the output, and a backward from the input and the
//! statistics alone.

use std::fmt;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::prelude::{Backend, Tensor};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

use super::super::kernels::{generic, Act, Grouping, NormKernels, View, Wanted};
use super::{Normalised, Statistics};

pub(super) fn inv_std<K: Backend>(var: FloatTensor<K>, epsilon: f64) -> FloatTensor<K> {
    let var = Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(var));
    var.add_scalar(epsilon)
        .sqrt()
        .recip()
        .into_primitive()
        .tensor()
}

/// Without autodiff: statistics, then the output.
#[allow(clippy::too_many_arguments)]
pub(super) fn untracked<K: NormKernels>(
    x: FloatTensor<K>,
    gamma: FloatTensor<K>,
    beta: FloatTensor<K>,
    statistics: Statistics<K>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<K> {
    let (mean, var, batch) = statistics.of(&x, view, grouping);
    let invstd = inv_std::<K>(var.clone(), epsilon);
    let output = K::norm_apply(x, view, grouping, &mean, &invstd, &gamma, &beta, act);
    Normalised {
        output,
        batch_stats: batch.then_some((mean, var)),
    }
}

/// On `Autodiff<K>`: one node, whose backward is [`NormKernels::norm_backward`].
#[allow(clippy::too_many_arguments)]
pub(super) fn tracked<K: NormKernels>(
    x: FloatTensor<Autodiff<K>>,
    gamma: FloatTensor<Autodiff<K>>,
    beta: FloatTensor<Autodiff<K>>,
    statistics: Statistics<Autodiff<K>>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<Autodiff<K>> {
    let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
    let (xi, gi, bi) = (inner(x.clone()), inner(gamma.clone()), inner(beta.clone()));
    let (mean, var, batch) = statistics.inner().of(&xi, view, grouping);
    let invstd = inv_std::<K>(var.clone(), epsilon);
    let output = K::norm_apply(xi.clone(), view, grouping, &mean, &invstd, &gi, &bi, act);
    let nodes = [x.node.clone(), gamma.node.clone(), beta.node.clone()];
    let output = match NormBackward
        .prepare::<NoCheckpointing>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            NormState {
                x: xi,
                mean: mean.clone(),
                invstd,
                gamma: gi,
                beta: bi,
                view,
                grouping,
                act,
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

/// Any other backend: the same arithmetic as tensor ops.
#[allow(clippy::too_many_arguments)]
pub(super) fn composed<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    statistics: Statistics<B>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<B> {
    let (mean, var, batch) = match statistics {
        // Tensor ops: the statistics must be computed here for Burn to differentiate them.
        Statistics::Batch | Statistics::Recorded { .. } => {
            let (mean, var) = generic::stats::<B>(&x, view, grouping);
            (mean, var, true)
        }
        Statistics::Running { mean, var } => (mean, var, false),
    };
    let invstd = inv_std::<B>(var.clone(), epsilon);
    let output = generic::apply::<B>(x, view, grouping, &mean, &invstd, &gamma, &beta, act);
    let detach = |t: FloatTensor<B>| {
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t))
            .detach()
            .into_primitive()
            .tensor()
    };
    Normalised {
        output,
        batch_stats: batch.then(|| (detach(mean), detach(var))),
    }
}

#[derive(Clone)]
pub(super) struct NormState<K: Backend> {
    x: FloatTensor<K>,
    mean: FloatTensor<K>,
    invstd: FloatTensor<K>,
    gamma: FloatTensor<K>,
    beta: FloatTensor<K>,
    view: View,
    grouping: Grouping,
    act: Act,
    batch: bool,
}

impl<K: Backend> fmt::Debug for NormState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NormState({:?}, {:?}, {:?})",
            self.view, self.grouping, self.act
        )
    }
}

#[derive(Debug)]
pub(super) struct NormBackward;

impl<K: NormKernels> Backward<K, 3> for NormBackward {
    type State = NormState<K>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pg, pb] = ops.parents;
        let dy = grads.consume::<K>(&ops.node);
        let s = ops.state;
        let wanted = Wanted {
            input: px.is_some(),
            affine: pg.is_some() || pb.is_some(),
            batch_stats: s.batch,
        };
        let (dx, dgamma, dbeta) = K::norm_backward(
            &s.x, dy, s.view, s.grouping, &s.mean, &s.invstd, &s.gamma, &s.beta, s.act, wanted,
        );
        if let (Some(node), Some(dx)) = (px, dx) {
            grads.register::<K>(node.id, dx);
        }
        if let (Some(node), Some(dgamma)) = (pg, dgamma) {
            grads.register::<K>(node.id, dgamma);
        }
        if let (Some(node), Some(dbeta)) = (pb, dbeta) {
            grads.register::<K>(node.id, dbeta);
        }
    }
}
