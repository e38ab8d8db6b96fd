use burn::nn::conv::Conv2d;
use burn::nn::Linear;
use burn::nn::PaddingConfig2d;
use burn::prelude::Backend;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Tensor, TensorPrimitive};

use super::ops;

/// `conv.forward(x)` for one of Burn's `Conv2d` layers, with memsave's backward: on Flex the
/// weight gradient is one matrix product per sample over an im2col buffer, contiguous and
/// exactly the weight's size (Burn's default makes two strided activation-sized copies and a
/// strided, sometimes fourfold, weight gradient). On Flex, fp32 convolutions with one group
/// run memsave's kernels for the forward and the input gradient too (`kernels::conv`); other
/// backends and types run the backend's own. Asymmetric `Same` padding (an even kernel) runs
/// Burn's forward as it is.
///
/// - x: `[batch, channels_in, height, width]`
/// - output: `[batch, channels_out, height_out, width_out]`
pub fn conv2d<B: Backend>(conv: &Conv2d<B>, x: Tensor<B, 4>) -> Tensor<B, 4> {
    let Some(options) = conv_options(conv, x.dims()) else {
        if super::frozen::frozen_weights().is_empty() {
            return conv.forward(x);
        }
        // A frozen weight held compressed: Burn's forward on a layer with its dequantized
        // value.
        let mut dequantized = conv.clone();
        let weight = super::frozen::weight_of(&conv.weight, x.dtype());
        dequantized.weight = burn::module::Param::initialized(conv.weight.id, weight);
        return dequantized.forward(x);
    };
    let weight = super::frozen::weight_of(&conv.weight, x.dtype());
    let output = ops::conv2d::<B>(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        conv.bias
            .as_ref()
            .map(|bias| bias.val().into_primitive().tensor()),
        options,
    );
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// `linear.forward(x)` for one of Burn's `Linear` layers on `[N, in]` inputs, whose weight
/// gradient is added into the gradient the weight has so far in place (under gradient
/// accumulation, the group's sums: Burn's op makes the new gradient, and a transposed copy of
/// it, beside them). Other ranks run Burn's forward as it is.
///
/// - x: `[batch, in]`
/// - output: `[batch, out]`
pub fn linear<B: Backend, const D: usize>(linear: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    if D != 2 {
        return linear.forward(x);
    }
    let weight = super::frozen::weight_of(&linear.weight, x.dtype());
    let output = ops::linear::<B>(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        linear
            .bias
            .as_ref()
            .map(|bias| bias.val().into_primitive().tensor()),
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

/// The output dims of `conv` on an input of `dims` with `options`.
pub(super) fn conv_output_dims<B: Backend>(
    conv: &Conv2d<B>,
    dims: [usize; 4],
    options: &ConvOptions<2>,
) -> [usize; 4] {
    let out = |axis: usize| {
        let span = options.dilation[axis] * (conv.kernel_size[axis] - 1) + 1;
        (dims[2 + axis] + 2 * options.padding[axis]).saturating_sub(span) / options.stride[axis] + 1
    };
    [dims[0], conv.weight.dims()[0], out(0), out(1)]
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
