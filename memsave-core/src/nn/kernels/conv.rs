//! The weight gradient of a 2-D convolution on Flex, as matrix products over an im2col buffer.
//!
//! Burn's default (`conv2d_weight_backward`) convolves the transposed input with the transposed
//! output gradient: on Flex that makes two strided copies of activation size, and returns a
//! transposed view, into a buffer four times the weight's size for a stride-2 1x1 convolution,
//! which the optimizer then reads element by element. Here: for each sample,
//! `dW[co, (ci, i, j)] += dY[co, p] * col[(ci, i, j), p]` with `gemm` (the crate Flex's own
//! convolution uses), where `col` is the im2col of the sample (or the sample itself for a 1x1
//! convolution with stride 1 and no padding); the result is contiguous and exactly the weight's
//! size.

use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Shape, TensorData};
use burn_flex::FlexTensor;
use gemm::{gemm, Parallelism};
use half::{bf16, f16};
use rayon::prelude::*;

fn contiguous(x: &FlexTensor) -> FlexTensor {
    if x.is_contiguous() && x.layout().start_offset() == 0 {
        x.clone()
    } else {
        x.to_contiguous()
    }
}

/// The values of `t` as f32: borrowed when they are f32, converted otherwise.
fn f32_values(t: &FlexTensor) -> std::borrow::Cow<'_, [f32]> {
    match t.dtype() {
        DType::F32 => std::borrow::Cow::Borrowed(t.as_slice::<f32>().expect("contiguous")),
        DType::F16 => std::borrow::Cow::Owned(
            t.as_slice::<f16>()
                .expect("contiguous")
                .iter()
                .map(|v| v.to_f32())
                .collect(),
        ),
        DType::BF16 => std::borrow::Cow::Owned(
            t.as_slice::<bf16>()
                .expect("contiguous")
                .iter()
                .map(|v| v.to_f32())
                .collect(),
        ),
        other => panic!("conv2d weight gradient: unsupported dtype {other:?}"),
    }
}

/// Whether [`weight_grad`] handles these options (one group); otherwise Burn's default runs.
pub(crate) fn supports(options: &ConvOptions<2>) -> bool {
    options.groups == 1
}

/// `dW` of `y = conv2d(x, w)`: x `[N, Ci, H, W]`, dy `[N, Co, Ho, Wo]`, result
/// `weight_shape = [Co, Ci, kh, kw]` in `dtype`, contiguous.
pub(crate) fn weight_grad(
    x: &FlexTensor,
    dy: &FlexTensor,
    weight_shape: [usize; 4],
    dtype: DType,
    options: &ConvOptions<2>,
) -> FlexTensor {
    let x = contiguous(x);
    let dy = contiguous(dy);
    let xd = x.layout().shape().to_vec();
    let yd = dy.layout().shape().to_vec();
    let (n, ci, h, w) = (xd[0], xd[1], xd[2], xd[3]);
    let (co, ho, wo) = (yd[1], yd[2], yd[3]);
    let [_, _, kh, kw] = weight_shape;
    let (k, p) = (ci * kh * kw, ho * wo);
    let xs = f32_values(&x);
    let dys = f32_values(&dy);
    let direct = kh == 1
        && kw == 1
        && options.stride == [1, 1]
        && options.padding == [0, 0]
        && ho == h
        && wo == w;
    let mut dw = vec![0.0f32; co * k];
    let mut col = if direct {
        Vec::new()
    } else {
        vec![0.0f32; k * p]
    };
    for sample in 0..n {
        let xn = &xs[sample * ci * h * w..(sample + 1) * ci * h * w];
        let dyn_ = &dys[sample * co * p..(sample + 1) * co * p];
        let rhs = if direct {
            xn.as_ptr()
        } else {
            im2col(xn, [ci, h, w], [kh, kw], [ho, wo], options, &mut col);
            col.as_ptr()
        };
        // dst (co x k) += lhs (co x p) * rhs (p x k), with rhs[p, q] = col[q * P + p].
        // SAFETY: every pointer covers the rows and columns its strides reach: dst co*k
        // elements, lhs co*p, rhs k*p; none overlaps dst.
        unsafe {
            gemm(
                co,
                k,
                p,
                dw.as_mut_ptr(),
                1,
                k as isize,
                sample > 0,
                dyn_.as_ptr(),
                1,
                p as isize,
                rhs,
                p as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                Parallelism::Rayon(0),
            );
        }
    }
    let shape = Shape::from(weight_shape.to_vec());
    match dtype {
        DType::F16 => FlexTensor::from_data(TensorData::new(
            dw.into_iter().map(f16::from_f32).collect::<Vec<_>>(),
            shape,
        )),
        DType::BF16 => FlexTensor::from_data(TensorData::new(
            dw.into_iter().map(bf16::from_f32).collect::<Vec<_>>(),
            shape,
        )),
        _ => FlexTensor::from_data(TensorData::new(dw, shape)),
    }
}

/// `col[(c, i, j), (oh, ow)] = x[c, oh * s - pad + i * d, ow * s - pad + j * d]`, 0 outside.
fn im2col(
    x: &[f32],
    [ci, h, w]: [usize; 3],
    [kh, kw]: [usize; 2],
    [ho, wo]: [usize; 2],
    options: &ConvOptions<2>,
    col: &mut [f32],
) {
    let [sh, sw] = options.stride;
    let [ph, pw] = options.padding;
    let [dh, dw] = options.dilation;
    let p = ho * wo;
    col.par_chunks_mut(p).enumerate().for_each(|(row, out)| {
        let (c, rest) = (row / (kh * kw), row % (kh * kw));
        let (i, j) = (rest / kw, rest % kw);
        let plane = &x[c * h * w..(c + 1) * h * w];
        for oh in 0..ho {
            let ih = (oh * sh + i * dh) as isize - ph as isize;
            let line = &mut out[oh * wo..(oh + 1) * wo];
            if ih < 0 || ih >= h as isize {
                line.fill(0.0);
                continue;
            }
            let src = &plane[ih as usize * w..(ih as usize + 1) * w];
            for (ow, value) in line.iter_mut().enumerate() {
                let iw = (ow * sw + j * dw) as isize - pw as isize;
                *value = if iw < 0 || iw >= w as isize {
                    0.0
                } else {
                    src[iw as usize]
                };
            }
        }
    });
    let _ = ci;
}
