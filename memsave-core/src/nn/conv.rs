use burn::nn::conv::Conv2d;
use burn::nn::PaddingConfig2d;
use burn::prelude::Backend;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Tensor, TensorPrimitive};

use super::ops;

/// `conv.forward(x)` for one of Burn's `Conv2d` layers, with memsave's backward: on Flex the
/// weight gradient is one matrix product per sample over an im2col buffer, contiguous and
/// exactly the weight's size (Burn's default makes two strided activation-sized copies and a
/// strided, sometimes fourfold, weight gradient). The forward and the input gradient are the
/// backend's own. Asymmetric `Same` padding (an even kernel) runs Burn's forward as it is.
///
/// - x: `[batch, channels_in, height, width]`
/// - output: `[batch, channels_out, height_out, width_out]`
pub fn conv2d<B: Backend>(conv: &Conv2d<B>, x: Tensor<B, 4>) -> Tensor<B, 4> {
    let Some(options) = conv_options(conv, x.dims()) else {
        return conv.forward(x);
    };
    let output = ops::conv2d::<B>(
        x.into_primitive().tensor(),
        conv.weight.val().into_primitive().tensor(),
        conv.bias
            .as_ref()
            .map(|bias| bias.val().into_primitive().tensor()),
        options,
    );
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backend's options for `conv` on an input of `dims`; `None` for asymmetric padding.
pub(super) fn conv_options<B: Backend>(
    conv: &Conv2d<B>,
    dims: [usize; 4],
) -> Option<ConvOptions<2>> {
    let [_, _, height, width] = dims;
    let ((top, bottom), (left, right)) = match conv.padding {
        PaddingConfig2d::Valid => ((0, 0), (0, 0)),
        PaddingConfig2d::Explicit(top, left, bottom, right) => ((top, bottom), (left, right)),
        PaddingConfig2d::Same => (
            same_padding(conv.kernel_size[0], conv.stride[0], height),
            same_padding(conv.kernel_size[1], conv.stride[1], width),
        ),
    };
    (top == bottom && left == right)
        .then(|| ConvOptions::new(conv.stride, [top, left], conv.dilation, conv.groups))
}

/// PyTorch's and Burn's `same`: `(start, end)` padding keeping `ceil(size / stride)` outputs.
pub(super) fn same_padding(kernel: usize, stride: usize, size: usize) -> (usize, usize) {
    let out = size.div_ceil(stride);
    let total = if out > 0 {
        ((out - 1) * stride + kernel).saturating_sub(size)
    } else {
        0
    };
    (total / 2, total - total / 2)
}
