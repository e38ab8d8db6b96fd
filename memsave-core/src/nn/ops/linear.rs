//! A linear layer `y = x * W + b` on `[N, in]` inputs whose weight gradient is added into the
//! gradient the weight has so far, in place (see [`super::conv::register_weight_grad`]).

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

use super::super::kernels::ConvKernels;
use super::conv::node_key;

pub(super) fn tracked_linear<K: ConvKernels>(
    x: FloatTensor<Autodiff<K>>,
    weight: FloatTensor<Autodiff<K>>,
    bias: Option<FloatTensor<Autodiff<K>>>,
) -> FloatTensor<Autodiff<K>> {
    let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
    let (xi, wi) = (inner(x.clone()), inner(weight.clone()));
    let product = Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(K::float_matmul(
        xi.clone(),
        wi.clone(),
    )));
    let output = match &bias {
        Some(bias) => {
            let bias = Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(inner(bias.clone())));
            product + bias.unsqueeze_dim(0)
        }
        None => product,
    }
    .into_primitive()
    .tensor();
    let bias_node = match &bias {
        Some(bias) => bias.node.clone(),
        None => node_key::<K>(&wi).node,
    };
    match LinearBackward
        .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone(), bias_node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(LinearState { x: xi, weight: wi }, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

#[derive(Clone)]
struct LinearState<K: Backend> {
    x: FloatTensor<K>,
    weight: FloatTensor<K>,
}

impl<K: Backend> fmt::Debug for LinearState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Linear")
    }
}

#[derive(Debug)]
struct LinearBackward;

impl<K: ConvKernels> Backward<K, 3> for LinearBackward {
    type State = LinearState<K>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let dy = grads.consume::<K>(&ops.node);
        let LinearState { x, weight } = ops.state;
        if let Some(node) = pb {
            let dy = Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(dy.clone()));
            let db = dy.sum_dim(0).squeeze_dim::<1>(0);
            grads.register::<K>(node.id, db.into_primitive().tensor());
        }
        if let Some(node) = px {
            let dx = K::float_matmul(dy.clone(), K::float_transpose(weight.clone()));
            grads.register::<K>(node.id, dx);
        }
        if let Some(node) = pw {
            let mut key = node_key::<K>(&weight);
            key.node = node;
            let dw = K::linear_weight_grad_onto(x, dy, grads.remove::<K>(&key));
            grads.register::<K>(key.node.id, dw);
        }
    }
}
