//! 2-D convolutions on Flex as matrix products over an im2col buffer, one sample at a time:
//! the forward, the input gradient and the weight gradient, in fp32 with one group.
//!
//! - Forward: `y[co, p] = W[co, q] * col[q, p]` (`q = (ci, i, j)`, `p = (oh, ow)`), `col` the
//!   im2col of the sample (or the sample itself for a 1x1 convolution with stride 1 and no
//!   padding). Flex's own forward first transposes the whole input to NHWC on one thread.
//! - Input gradient: `col = W^T * dY`, then col2im, one input channel per task. Flex's runs as a
//!   transposed convolution, also partly on one thread.
//! - Weight gradient: `dW[co, q] += dY[co, p] * col[q, p]`. Burn's default
//!   (`conv2d_weight_backward`) convolves the transposed input with the transposed output
//!   gradient: on Flex that makes two strided copies of activation size, and returns a
//!   transposed view, into a buffer four times the weight's size for a stride-2 1x1
//!   convolution, which the optimizer then reads element by element. Here the result is
//!   contiguous and exactly the weight's size.
//!
//! Products run on `gemm` (the crate Flex's own convolution uses) with rayon's pool; im2col and
//! col2im are split over rows and channels on the same pool.

use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Shape, TensorData};
use burn_flex::FlexTensor;
use gemm::{gemm, Parallelism};
use half::{bf16, f16};
use rayon::prelude::*;

use super::im2col::{col2im_rows, im2col, im2col_rows, Geometry};

/// `x`, contiguous from its start (itself when it already is).
pub(super) fn contiguous(x: &FlexTensor) -> FlexTensor {
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

/// Whether [`forward`] and [`input_grad`] handle these tensors: fp32, one group.
pub(crate) fn supports_f32(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> bool {
    options.groups == 1 && x.dtype() == DType::F32 && weight.dtype() == DType::F32
}

/// Elements (fp32) of the im2col buffers of a whole batch below which [`input_grad`] runs one
/// task per sample (each with a buffer of its own: at most this much in all, 1 MiB).
const SMALL: usize = 1 << 18;

/// Output positions per task of [`forward`]: whole output rows, about this many.
const TILE: usize = 512;

/// A pointer that tasks writing disjoint parts of one buffer share.
#[derive(Clone, Copy)]
struct Shared(*mut f32);

// SAFETY: every task writes its own rows and columns of the buffer (see `forward`).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// `conv2d(x, weight) + bias` for fp32 tensors with one group (see [`supports_f32`]). One task
/// per sample and tile of output rows: the tile's im2col (a few hundred KiB, in cache), then
/// `y[:, tile] = W * col`.
pub(crate) fn forward(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: Option<&FlexTensor>,
    options: &ConvOptions<2>,
) -> FlexTensor {
    let (x, weight) = (contiguous(x), contiguous(weight));
    let g = Geometry::new(x.layout().shape(), weight.layout().shape(), options);
    let (q, p) = (g.q(), g.p());
    let xs = x.as_slice::<f32>().expect("contiguous f32");
    let ws = weight.as_slice::<f32>().expect("contiguous f32");
    let direct = g.direct(options);
    let bias = bias.map(|bias| f32_values(&contiguous(bias)).into_owned());
    let rows_per_tile = (TILE / g.wo.max(1)).clamp(1, g.ho.max(1));
    let tiles = g.ho.div_ceil(rows_per_tile);
    let mut y = vec![0.0f32; g.n * g.co * p];
    let out = Shared(y.as_mut_ptr());
    (0..g.n * tiles).into_par_iter().for_each(|task| {
        let out = out;
        let (sample, tile) = (task / tiles, task % tiles);
        let rows = tile * rows_per_tile..((tile + 1) * rows_per_tile).min(g.ho);
        let (first, len) = (rows.start * g.wo, rows.len() * g.wo);
        let xn = &xs[sample * g.ci * g.h * g.w..(sample + 1) * g.ci * g.h * g.w];
        let mut col = Vec::new();
        let (rhs, rhs_rs) = if direct {
            (xn[first..].as_ptr(), p)
        } else {
            col.resize(q * len, 0.0f32);
            im2col_rows(xn, &g, options, rows, &mut col);
            (col.as_ptr(), len)
        };
        // SAFETY: dst is this task's columns `first..first + len` of sample `sample`'s co x p
        // block (row stride p), which no other task writes; lhs covers co*q elements; rhs
        // q rows of `len` columns at stride `rhs_rs`, inside `xn` or `col`.
        unsafe {
            let dst = out.0.add(sample * g.co * p + first);
            gemm(
                g.co,
                len,
                q,
                dst,
                1,
                p as isize,
                false,
                ws.as_ptr(),
                1,
                q as isize,
                rhs,
                1,
                rhs_rs as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                Parallelism::None,
            );
            if let Some(bias) = &bias {
                for (c, b) in bias.iter().enumerate() {
                    let line = std::slice::from_raw_parts_mut(dst.add(c * p), len);
                    line.iter_mut().for_each(|v| *v += b);
                }
            }
        }
    });
    FlexTensor::from_data(TensorData::new(y, Shape::from(vec![g.n, g.co, g.ho, g.wo])))
}

/// `dX` of `y = conv2d(x, w)` for fp32 tensors with one group (see [`supports_f32`]): x's
/// shape `x_shape`, dy `[N, Co, Ho, Wo]`.
pub(crate) fn input_grad(
    x_shape: &[usize],
    weight: &FlexTensor,
    dy: &FlexTensor,
    options: &ConvOptions<2>,
) -> FlexTensor {
    let (weight, dy) = (contiguous(weight), contiguous(dy));
    let g = Geometry::new(x_shape, weight.layout().shape(), options);
    assert_eq!(
        dy.layout().shape().to_vec(),
        vec![g.n, g.co, g.ho, g.wo],
        "conv2d input gradient: the output gradient's shape does not match the convolution"
    );
    let (q, p, plane) = (g.q(), g.p(), g.h * g.w);
    let ws = weight.as_slice::<f32>().expect("contiguous f32");
    let dys = dy.as_slice::<f32>().expect("contiguous f32");
    let direct = g.direct(options);
    let mut dx = vec![0.0f32; g.n * g.ci * plane];
    // dst (q x p) = W^T * dY, computed as its transpose dY^T * W (p x q), in blocks of
    // `ROWS` rows of dst, one task each: gemm packs the operands of one block only (a
    // product over the whole weight would pack all of it, a weight's size).
    const ROWS: usize = 128;
    // SAFETY (for callers): rows `first..first + rows` of dst (q x p, row stride p) are the
    // caller's alone; dY covers co*p elements, W co*q (columns `first..first + rows` read at
    // row stride q).
    let block = |dst: Shared, dy: &[f32], first: usize| unsafe {
        let rows = ROWS.min(q - first);
        gemm(
            p,
            rows,
            g.co,
            dst.0.add(first * p),
            p as isize,
            1,
            false,
            dy.as_ptr(),
            p as isize,
            1,
            ws.as_ptr().add(first),
            1,
            q as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    };
    if g.n * q * p <= SMALL {
        // Small outputs (late layers, small images): one task per sample, which runs its
        // blocks and its col2im itself; splitting one sample's small product across the
        // threads would cost more than it gains.
        dx.par_chunks_mut(g.ci * plane)
            .enumerate()
            .for_each(|(sample, dxn)| {
                let dyn_ = &dys[sample * g.co * p..(sample + 1) * g.co * p];
                let mut col = if direct {
                    Vec::new()
                } else {
                    vec![0.0f32; q * p]
                };
                let dst = Shared(if direct {
                    dxn.as_mut_ptr()
                } else {
                    col.as_mut_ptr()
                });
                for first in (0..q).step_by(ROWS) {
                    block(dst, dyn_, first);
                }
                if !direct {
                    for (c, plane) in dxn.chunks_mut(plane).enumerate() {
                        col2im_rows(&col, &g, options, 0..g.ho, c, plane);
                    }
                }
            });
        return FlexTensor::from_data(TensorData::new(dx, Shape::from(x_shape.to_vec())));
    }
    // One sample at a time, its blocks one task each, then col2im one input channel per task.
    let product = |dst: Shared, dy: &[f32]| {
        (0..q.div_ceil(ROWS))
            .into_par_iter()
            .for_each(|index| block(dst, dy, index * ROWS))
    };
    let mut col = if direct {
        Vec::new()
    } else {
        vec![0.0f32; q * p]
    };
    for sample in 0..g.n {
        let dyn_ = &dys[sample * g.co * p..(sample + 1) * g.co * p];
        let dxn = &mut dx[sample * g.ci * plane..(sample + 1) * g.ci * plane];
        if direct {
            product(Shared(dxn.as_mut_ptr()), dyn_);
            continue;
        }
        product(Shared(col.as_mut_ptr()), dyn_);
        let col = &col;
        dxn.par_chunks_mut(plane)
            .enumerate()
            .for_each(|(c, out)| col2im_rows(col, &g, options, 0..g.ho, c, out));
    }
    FlexTensor::from_data(TensorData::new(dx, Shape::from(x_shape.to_vec())))
}

/// `dW` of `y = conv2d(x, w)`: x `[N, Ci, H, W]`, dy `[N, Co, Ho, Wo]`, result
/// `weight_shape = [Co, Ci, kh, kw]` in `dtype`, contiguous.
///
/// With `onto` (an fp32, contiguous gradient of the weight's shape that nothing else holds, for
/// an fp32 weight), the result is added into it in place and returned: no second weight-sized
/// buffer exists (the sums of earlier micro-batches under accumulation). Otherwise `onto`, if
/// any, is handed back untouched beside a new gradient.
pub(crate) fn weight_grad_onto(
    x: &FlexTensor,
    dy: &FlexTensor,
    weight_shape: [usize; 4],
    dtype: DType,
    options: &ConvOptions<2>,
    onto: FlexTensor,
) -> Result<FlexTensor, (FlexTensor, FlexTensor)> {
    let fits = dtype == DType::F32
        && onto.dtype() == DType::F32
        && onto.layout().shape().to_vec() == weight_shape.to_vec()
        && onto.is_contiguous()
        && onto.layout().start_offset() == 0
        && onto.is_unique();
    if !fits {
        return Err((weight_grad(x, dy, weight_shape, dtype, options), onto));
    }
    let mut onto = onto;
    let dw = onto
        .try_storage_mut::<f32>()
        .expect("checked: unique, contiguous fp32");
    weight_grad_into(x, dy, weight_shape, options, dw, true);
    Ok(onto)
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
    let [co, ci, kh, kw] = weight_shape;
    let mut dw = vec![0.0f32; co * ci * kh * kw];
    weight_grad_into(x, dy, weight_shape, options, &mut dw, false);
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

/// `dw += dW` (`add`) or `dw = dW`, fp32, `dw` of the weight's size.
fn weight_grad_into(
    x: &FlexTensor,
    dy: &FlexTensor,
    weight_shape: [usize; 4],
    options: &ConvOptions<2>,
    dw: &mut [f32],
    add: bool,
) {
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
    assert_eq!(
        dw.len(),
        co * k,
        "conv2d weight gradient: buffer of another size"
    );
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
                add || sample > 0,
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
}
