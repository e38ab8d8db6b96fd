//! Max pooling that keeps only the maxima's indices.

use std::fmt;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use super::super::kernels::LeanBackend;
use burn::tensor::TensorMetadata;

#[derive(Clone, Debug)]
pub(super) struct PoolOptions {
    pub(super) kernel: [usize; 2],
    pub(super) stride: [usize; 2],
    pub(super) padding: [usize; 2],
    pub(super) dilation: [usize; 2],
    pub(super) ceil_mode: bool,
}

pub(super) fn tracked_max_pool2d<K: LeanBackend>(
    x: FloatTensor<Autodiff<K>>,
    o: PoolOptions,
) -> FloatTensor<Autodiff<K>> {
    let xi = Autodiff::<K>::inner(x.clone());
    let (shape, dtype) = (xi.shape(), xi.dtype());
    let pooled =
        K::max_pool2d_with_indices(xi, o.kernel, o.stride, o.padding, o.dilation, o.ceil_mode);
    match MaxPoolBackward
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            PoolState {
                indices: pooled.indices,
                shape,
                dtype,
                options: o,
            },
            pooled.output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(pooled.output),
    }
}

#[derive(Clone)]
pub(super) struct PoolState<K: Backend> {
    indices: burn::tensor::ops::IntTensor<K>,
    shape: burn::tensor::Shape,
    dtype: burn::tensor::DType,
    options: PoolOptions,
}

impl<K: Backend> fmt::Debug for PoolState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolState({:?})", self.options)
    }
}

#[derive(Debug)]
pub(super) struct MaxPoolBackward;

impl<K: LeanBackend> Backward<K, 1> for MaxPoolBackward {
    type State = PoolState<K>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<K>(&ops.node);
        let Some(parent) = parent else { return };
        let s = ops.state;
        let o = s.options;
        let dx = K::max_pool2d_input_grad(
            s.shape,
            s.dtype,
            o.kernel,
            o.stride,
            o.padding,
            o.dilation,
            o.ceil_mode,
            grad,
            s.indices,
        );
        grads.register::<K>(parent.id, dx);
    }
}
