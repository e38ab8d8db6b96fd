//! The convolution whose backward computes the weight gradient with memsave's kernel.

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

use super::super::kernels::ConvKernels;

pub(super) fn tracked_conv2d<K: ConvKernels>(
    x: FloatTensor<Autodiff<K>>,
    weight: FloatTensor<Autodiff<K>>,
    bias: Option<FloatTensor<Autodiff<K>>>,
    options: ConvOptions<2>,
) -> FloatTensor<Autodiff<K>> {
    let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
    let (xi, wi) = (inner(x.clone()), inner(weight.clone()));
    let output = K::conv2d_forward(
        xi.clone(),
        wi.clone(),
        bias.clone().map(inner),
        options.clone(),
    );
    // Without a bias, an untracked leaf stands in its place: no gradient goes there.
    let bias_node = match &bias {
        Some(bias) => bias.node.clone(),
        None => {
            Autodiff::<K>::from_inner(super::super::kernels::generic::scalar_like::<K>(&wi)).node
        }
    };
    match Conv2dBackward
        .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone(), bias_node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            ConvState {
                x: xi,
                weight: wi,
                options,
            },
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

#[derive(Clone)]
pub(super) struct ConvState<K: Backend> {
    x: FloatTensor<K>,
    weight: FloatTensor<K>,
    options: ConvOptions<2>,
}

impl<K: Backend> fmt::Debug for ConvState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConvState({:?})", self.options)
    }
}

#[derive(Debug)]
pub(super) struct Conv2dBackward;

impl<K: ConvKernels> Backward<K, 3> for Conv2dBackward {
    type State = ConvState<K>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let dy = grads.consume::<K>(&ops.node);
        let ConvState { x, weight, options } = ops.state;
        if let Some(node) = pb {
            let dy = Tensor::<K, 4>::from_primitive(TensorPrimitive::Float(dy.clone()));
            let channels = dy.dims()[1];
            let db = dy.sum_dim(0).sum_dim(2).sum_dim(3).reshape([channels]);
            grads.register::<K>(node.id, db.into_primitive().tensor());
        }
        // The input gradient first: its temporaries are gone before the weight gradient exists.
        if let Some(node) = px {
            let dx = K::conv2d_input_grad(x.clone(), weight.clone(), dy.clone(), options.clone());
            grads.register::<K>(node.id, dx);
        }
        if let Some(node) = pw {
            let mut key = node_key::<K>(&weight);
            key.node = node;
            register_weight_grad::<K>(grads, key, x, weight, dy, options);
        }
    }
}

/// A tensor to stand for a node of the graph: its `node` field is set to the node, and
/// `Gradients::remove` reads only that (the node's type is not exported by name).
pub(super) fn node_key<K: Backend>(like: &FloatTensor<K>) -> FloatTensor<Autodiff<K>> {
    Autodiff::<K>::from_inner(super::super::kernels::generic::scalar_like::<K>(like))
}

/// Registers the weight gradient of a convolution for the weight's node (`key`, see
/// [`node_key`]). When the weight has a gradient already (the sums of earlier micro-batches,
/// seeded by accumulation; or its use elsewhere), the new one is added into it
/// ([`ConvKernels::conv2d_weight_grad_onto`]): on Flex in place, so that no second
/// weight-sized buffer exists beside the sum.
pub(super) fn register_weight_grad<K: ConvKernels>(
    grads: &mut Gradients,
    key: FloatTensor<Autodiff<K>>,
    x: FloatTensor<K>,
    weight: FloatTensor<K>,
    dy: FloatTensor<K>,
    options: ConvOptions<2>,
) {
    let dw = match grads.remove::<K>(&key) {
        Some(sum) => K::conv2d_weight_grad_onto(x, weight, dy, options, sum),
        None => K::conv2d_weight_grad(x, weight, dy, options),
    };
    grads.register::<K>(key.node.id, dw);
}
