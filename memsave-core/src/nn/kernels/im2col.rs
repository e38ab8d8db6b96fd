//! The im2col and col2im of memsave's convolution on Flex (see [`super::conv`]): a
//! convolution's geometry, a sample's (or some output rows') patches as the columns of a
//! matrix, and their sum back into an input plane.

use burn::tensor::ops::ConvOptions;
use rayon::prelude::*;

/// The geometry of one convolution.
pub(super) struct Geometry {
    pub(super) n: usize,
    pub(super) ci: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) co: usize,
    pub(super) kh: usize,
    pub(super) kw: usize,
    pub(super) ho: usize,
    pub(super) wo: usize,
}

impl Geometry {
    pub(super) fn new(x: &[usize], weight: &[usize], options: &ConvOptions<2>) -> Geometry {
        let out = |size: usize, kernel: usize, axis: usize| {
            let span = options.dilation[axis] * (kernel - 1) + 1;
            (size + 2 * options.padding[axis]).saturating_sub(span) / options.stride[axis] + 1
        };
        Geometry {
            n: x[0],
            ci: x[1],
            h: x[2],
            w: x[3],
            co: weight[0],
            kh: weight[2],
            kw: weight[3],
            ho: out(x[2], weight[2], 0),
            wo: out(x[3], weight[3], 1),
        }
    }

    /// Rows of the im2col buffer, `ci * kh * kw`.
    pub(super) fn q(&self) -> usize {
        self.ci * self.kh * self.kw
    }

    /// Output positions per sample.
    pub(super) fn p(&self) -> usize {
        self.ho * self.wo
    }

    /// A 1x1 convolution with stride 1 and no padding: the sample is its own im2col.
    pub(super) fn direct(&self, options: &ConvOptions<2>) -> bool {
        self.kh == 1
            && self.kw == 1
            && options.stride == [1, 1]
            && options.padding == [0, 0]
            && self.ho == self.h
            && self.wo == self.w
    }
}

/// The im2col of output rows `rows` of one sample: `col[(c, i, j), (oh - rows.start, ow)]`.
pub(super) fn im2col_rows(
    x: &[f32],
    g: &Geometry,
    options: &ConvOptions<2>,
    rows: std::ops::Range<usize>,
    col: &mut [f32],
) {
    let [sh, sw] = options.stride;
    let [ph, pw] = options.padding;
    let [dh, dw] = options.dilation;
    let len = rows.len() * g.wo;
    for (row, out) in col.chunks_mut(len).enumerate() {
        let (c, rest) = (row / (g.kh * g.kw), row % (g.kh * g.kw));
        let (i, j) = (rest / g.kw, rest % g.kw);
        let plane = &x[c * g.h * g.w..(c + 1) * g.h * g.w];
        for (local, oh) in rows.clone().enumerate() {
            let ih = (oh * sh + i * dh) as isize - ph as isize;
            let line = &mut out[local * g.wo..(local + 1) * g.wo];
            if ih < 0 || ih >= g.h as isize {
                line.fill(0.0);
                continue;
            }
            let src = &plane[ih as usize * g.w..(ih as usize + 1) * g.w];
            for (ow, value) in line.iter_mut().enumerate() {
                let iw = (ow * sw + j * dw) as isize - pw as isize;
                *value = if iw < 0 || iw >= g.w as isize {
                    0.0
                } else {
                    src[iw as usize]
                };
            }
        }
    }
}

/// `x[c, oh * s - pad + i * d, ow * s - pad + j * d] += col[(c, i, j), (oh - rows.start, ow)]`
/// for one channel `c` (`plane`: its `h x w` values) and output rows `rows`.
pub(super) fn col2im_rows(
    col: &[f32],
    g: &Geometry,
    options: &ConvOptions<2>,
    rows: std::ops::Range<usize>,
    c: usize,
    plane: &mut [f32],
) {
    let [sh, sw] = options.stride;
    let [ph, pw] = options.padding;
    let [dh, dw] = options.dilation;
    let (len, taps) = (rows.len() * g.wo, g.kh * g.kw);
    for tap in 0..taps {
        let (i, j) = (tap / g.kw, tap % g.kw);
        let row = &col[(c * taps + tap) * len..(c * taps + tap + 1) * len];
        for (local, oh) in rows.clone().enumerate() {
            let ih = (oh * sh + i * dh) as isize - ph as isize;
            if ih < 0 || ih >= g.h as isize {
                continue;
            }
            let line = &mut plane[ih as usize * g.w..(ih as usize + 1) * g.w];
            let src = &row[local * g.wo..(local + 1) * g.wo];
            for (ow, value) in src.iter().enumerate() {
                let iw = (ow * sw + j * dw) as isize - pw as isize;
                if iw >= 0 && iw < g.w as isize {
                    line[iw as usize] += value;
                }
            }
        }
    }
}

/// `col[(c, i, j), (oh, ow)] = x[c, oh * s - pad + i * d, ow * s - pad + j * d]`, 0 outside.
pub(super) fn im2col(
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
