use burn::nn::pool::MaxPool2d;
use burn::nn::PaddingConfig2d;
use burn::prelude::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use super::conv::same_padding;
use super::ops;

/// `pool.forward(x)` for one of Burn's `MaxPool2d` layers, keeping for backward only the
/// indices of the maxima and the input's shape (on Flex; Burn's op keeps the input too, which
/// nothing else may need: in a ResNet's stem, the BN-ReLU output). Elsewhere, and for
/// asymmetric `Same` padding, Burn's forward runs as it is.
///
/// - x: `[batch, channels, height, width]`
/// - output: `[batch, channels, height_out, width_out]`
pub fn max_pool2d<B: Backend>(pool: &MaxPool2d, x: Tensor<B, 4>) -> Tensor<B, 4> {
    let Some(padding) = pool_padding(pool, x.dims()) else {
        return pool.forward(x);
    };
    let output = ops::max_pool2d::<B>(
        x.into_primitive().tensor(),
        pool.kernel_size,
        pool.stride,
        padding,
        pool.dilation,
        pool.ceil_mode,
    );
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backend's `[top, left]` padding for `pool` on an input of `dims`; `None` for asymmetric
/// padding.
pub(super) fn pool_padding(pool: &MaxPool2d, dims: [usize; 4]) -> Option<[usize; 2]> {
    let [_, _, height, width] = dims;
    let ((top, bottom), (left, right)) = match pool.padding {
        PaddingConfig2d::Valid => ((0, 0), (0, 0)),
        PaddingConfig2d::Explicit(top, left, bottom, right) => ((top, bottom), (left, right)),
        PaddingConfig2d::Same => (
            same_padding(pool.kernel_size[0], pool.stride[0], height),
            same_padding(pool.kernel_size[1], pool.stride[1], width),
        ),
    };
    (top == bottom && left == right).then_some([top, left])
}
