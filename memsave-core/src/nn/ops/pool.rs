//! Max pooling that keeps only the maxima's indices.

use std::fmt;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::backend::Flex;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps, ModuleOps};
use burn::tensor::TensorMetadata;

#[derive(Clone, Debug)]
pub(super) struct PoolOptions {
    pub(super) kernel: [usize; 2],
    pub(super) stride: [usize; 2],
    pub(super) padding: [usize; 2],
    pub(super) dilation: [usize; 2],
    pub(super) ceil_mode: bool,
}

pub(super) fn tracked_max_pool2d(
    x: FloatTensor<Autodiff<Flex>>,
    o: PoolOptions,
) -> FloatTensor<Autodiff<Flex>> {
    let xi = Autodiff::<Flex>::inner(x.clone());
    let (shape, dtype) = (xi.shape(), xi.dtype());
    let pooled =
        Flex::max_pool2d_with_indices(xi, o.kernel, o.stride, o.padding, o.dilation, o.ceil_mode);
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
pub(super) struct PoolState {
    indices: burn::tensor::ops::IntTensor<Flex>,
    shape: burn::tensor::Shape,
    dtype: burn::tensor::DType,
    options: PoolOptions,
}

impl fmt::Debug for PoolState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolState({:?})", self.options)
    }
}

#[derive(Debug)]
pub(super) struct MaxPoolBackward;

impl Backward<Flex, 1> for MaxPoolBackward {
    type State = PoolState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let Some(parent) = parent else { return };
        let s = ops.state;
        // Flex reads only the input's shape (and type): a broadcast zero stands in for it.
        let zero = Flex::float_zeros(
            burn::tensor::Shape::new([1, 1, 1, 1]),
            &Default::default(),
            s.dtype.into(),
        );
        let stand_in = Flex::float_expand(zero, s.shape);
        let o = s.options;
        let dx = Flex::max_pool2d_with_indices_backward(
            stand_in,
            o.kernel,
            o.stride,
            o.padding,
            o.dilation,
            o.ceil_mode,
            grad,
            s.indices,
        );
        grads.register::<Flex>(parent.id, dx.x_grad);
    }
}
