//! [`NormKernels`](super::NormKernels) on Flex: fused loops over raw slices, in parallel on
//! rayon's pool (the one Flex's own kernels use). Sums are taken in f64, so that the one-pass
//! variance `E[x^2] - E[x]^2` stays exact to fp32 for any input a network produces.

use burn::backend::Flex;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, Shape, TensorData};
use burn_flex::FlexTensor;
use half::{bf16, f16};
use rayon::prelude::*;

use super::{Act, Grouping, View, Wanted};

type T = FloatTensor<Flex>;

/// An element type a normalisation reads and writes.
trait Elem: bytemuck::Pod + Send + Sync + burn::tensor::Element {
    fn to(self) -> f32;
    fn of(value: f32) -> Self;
}

impl Elem for f32 {
    fn to(self) -> f32 {
        self
    }
    fn of(value: f32) -> Self {
        value
    }
}

impl Elem for f16 {
    fn to(self) -> f32 {
        self.to_f32()
    }
    fn of(value: f32) -> Self {
        f16::from_f32(value)
    }
}

impl Elem for bf16 {
    fn to(self) -> f32 {
        self.to_f32()
    }
    fn of(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

/// Runs `$body` with `$E` the element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $E = f32;
                $body
            }
            DType::F16 => {
                type $E = f16;
                $body
            }
            DType::BF16 => {
                type $E = bf16;
                $body
            }
            other => panic!("memsave's normalisation kernels take f32, f16 or bf16, not {other:?}"),
        }
    };
}

fn contiguous(x: &FlexTensor) -> FlexTensor {
    if x.is_contiguous() && x.layout().start_offset() == 0 {
        x.clone()
    } else {
        x.to_contiguous()
    }
}

/// The values of a small tensor (statistics, affine parameters) as f32.
fn values(t: &FlexTensor) -> Vec<f32> {
    let t = contiguous(t);
    match t.dtype() {
        DType::F32 => t.as_slice::<f32>().expect("contiguous").to_vec(),
        DType::F64 => t
            .as_slice::<f64>()
            .expect("contiguous")
            .iter()
            .map(|v| *v as f32)
            .collect(),
        dtype => by_dtype!(dtype, E => t
            .as_slice::<E>()
            .expect("contiguous")
            .iter()
            .map(|v| v.to())
            .collect()),
    }
}

fn tensor<E: Elem>(values: Vec<E>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, Shape::from(shape)))
}

fn f32_tensor(values: Vec<f32>) -> FlexTensor {
    let len = values.len();
    tensor(values, vec![len])
}

/// The contiguous ranges of the input that make up group `g`.
fn segments(view: View, grouping: Grouping, g: usize) -> impl Iterator<Item = (usize, usize)> {
    let (outer, channels, inner) = (view.outer, view.channels, view.inner);
    let (count, first, stride, len) = match grouping {
        Grouping::PerChannel => (outer, g * inner, channels * inner, inner),
        Grouping::PerSampleGroup { groups } => {
            let len = channels / groups * inner;
            (1, g * len, 0, len)
        }
        Grouping::PerRow => (1, g * inner, 0, inner),
    };
    (0..count).map(move |i| (first + i * stride, len))
}

/// The group of block `b` (a block is `inner` contiguous elements: one `(n, c)`).
fn block_group(view: View, grouping: Grouping, b: usize) -> usize {
    let (n, c) = (b / view.channels, b % view.channels);
    match grouping {
        Grouping::PerChannel => c,
        Grouping::PerSampleGroup { groups } => n * groups + c / (view.channels / groups),
        Grouping::PerRow => n,
    }
}

pub(super) fn stats(x: &T, view: View, grouping: Grouping) -> (T, T) {
    let x = contiguous(x);
    let groups = view.groups(grouping);
    let size = view.group_size(grouping) as f64;
    let (mean, var): (Vec<f32>, Vec<f32>) = by_dtype!(x.dtype(), E => {
        let data = x.as_slice::<E>().expect("contiguous");
        (0..groups)
            .into_par_iter()
            .map(|g| {
                let (mut sum, mut squares) = (0.0f64, 0.0f64);
                for (start, len) in segments(view, grouping, g) {
                    // f32 partial sums over short runs, f64 across them: exact enough and fast.
                    for chunk in data[start..start + len].chunks(256) {
                        let (mut s, mut q) = (0.0f32, 0.0f32);
                        for v in chunk {
                            let v = v.to();
                            s += v;
                            q += v * v;
                        }
                        sum += s as f64;
                        squares += q as f64;
                    }
                }
                let mean = sum / size;
                let var = (squares / size - mean * mean).max(0.0);
                (mean as f32, var as f32)
            })
            .unzip()
    });
    (f32_tensor(mean), f32_tensor(var))
}

/// Per element of a block: the affine index (a constant for channel groupings).
#[derive(Clone, Copy)]
enum Affine {
    Channel(usize),
    PerElement,
}

fn block_affine(view: View, grouping: Grouping, b: usize) -> Affine {
    match grouping {
        Grouping::PerRow => Affine::PerElement,
        _ => Affine::Channel(b % view.channels),
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn apply(
    x: T,
    view: View,
    grouping: Grouping,
    mean: &T,
    invstd: &T,
    gamma: &T,
    beta: &T,
    act: Act,
) -> T {
    let shape = x.layout().shape().to_vec();
    let x = contiguous(&x);
    let (mean, invstd, gamma, beta) = (values(mean), values(invstd), values(gamma), values(beta));
    let inner = view.inner;
    by_dtype!(x.dtype(), E => {
        let data = x.as_slice::<E>().expect("contiguous");
        let mut out = vec![E::of(0.0); data.len()];
        out.par_chunks_mut(inner)
            .zip(data.par_chunks(inner))
            .enumerate()
            .for_each(|(b, (out, x))| {
                let g = block_group(view, grouping, b);
                let (m, s) = (mean[g], invstd[g]);
                match block_affine(view, grouping, b) {
                    Affine::Channel(c) => {
                        let scale = s * gamma[c];
                        let shift = beta[c] - m * scale;
                        for (o, v) in out.iter_mut().zip(x) {
                            let z = v.to() * scale + shift;
                            *o = E::of(activate(z, act));
                        }
                    }
                    Affine::PerElement => {
                        for (i, (o, v)) in out.iter_mut().zip(x).enumerate() {
                            let z = (v.to() - m) * s * gamma[i] + beta[i];
                            *o = E::of(activate(z, act));
                        }
                    }
                }
            });
        tensor(out, shape)
    })
}

#[inline(always)]
fn activate(z: f32, act: Act) -> f32 {
    match act {
        Act::Identity => z,
        Act::Relu => z.max(0.0),
    }
}

/// `dz` from `dy` and the recomputed pre-activation `z`.
#[inline(always)]
fn through(dy: f32, z: f32, act: Act) -> f32 {
    match act {
        Act::Identity => dy,
        Act::Relu => {
            if z > 0.0 {
                dy
            } else {
                0.0
            }
        }
    }
}

/// Per block: `sum(dz)` and `sum(dz * xhat)` (channel groupings), or per row the group sums of
/// `g = dz * gamma` and `g * xhat` plus per-feature partials (rows).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    x: &T,
    dy: T,
    view: View,
    grouping: Grouping,
    mean: &T,
    invstd: &T,
    gamma: &T,
    beta: &T,
    act: Act,
    wanted: Wanted,
) -> (Option<T>, Option<T>, Option<T>) {
    let shape = x.layout().shape().to_vec();
    let x = contiguous(x);
    // The gradient of the output has the output's dtype, which is the input's.
    let dy = if dy.dtype() == x.dtype() {
        contiguous(&dy)
    } else {
        contiguous(&Flex::float_cast(dy, x.dtype().into()))
    };
    let (mean, invstd, gamma, beta) = (values(mean), values(invstd), values(gamma), values(beta));
    let inner = view.inner;
    let blocks = view.outer * view.channels;
    let groups = view.groups(grouping);
    let affine = view.affine(grouping);
    let size = view.group_size(grouping) as f32;

    by_dtype!(x.dtype(), E => {
        let xs = x.as_slice::<E>().expect("contiguous");
        let dys = dy.as_slice::<E>().expect("contiguous, in the input's dtype");
        let dy_at = |i: usize| -> f32 { dys[i].to() };

        // Pass 1: sums per block (and, for rows, per feature).
        let (block_sums, feature_sums): (Vec<(f32, f32)>, Vec<(f64, f64)>) = match grouping {
            Grouping::PerRow => {
                let feature = (0..blocks)
                    .into_par_iter()
                    .fold(
                        || (vec![(0.0f64, 0.0f64); affine], Vec::new()),
                        |(mut features, mut rows): (Vec<(f64, f64)>, Vec<(usize, (f32, f32))>), b| {
                            let (m, s) = (mean[b], invstd[b]);
                            let (mut sg, mut sgx) = (0.0f32, 0.0f32);
                            for i in 0..inner {
                                let e = b * inner + i;
                                let xhat = (xs[e].to() - m) * s;
                                let dz = through(dy_at(e), xhat * gamma[i] + beta[i], act);
                                features[i].0 += dz as f64;
                                features[i].1 += (dz * xhat) as f64;
                                let g = dz * gamma[i];
                                sg += g;
                                sgx += g * xhat;
                            }
                            rows.push((b, (sg, sgx)));
                            (features, rows)
                        },
                    )
                    .reduce(
                        || (vec![(0.0f64, 0.0f64); affine], Vec::new()),
                        |(mut a, mut ra), (b, rb)| {
                            for (x, y) in a.iter_mut().zip(b) {
                                x.0 += y.0;
                                x.1 += y.1;
                            }
                            ra.extend(rb);
                            (a, ra)
                        },
                    );
                let mut rows = vec![(0.0f32, 0.0f32); blocks];
                for (b, sums) in feature.1 {
                    rows[b] = sums;
                }
                (rows, feature.0)
            }
            _ => {
                let sums = (0..blocks)
                    .into_par_iter()
                    .map(|b| {
                        let g = block_group(view, grouping, b);
                        let c = b % view.channels;
                        let (m, s) = (mean[g], invstd[g]);
                        let scale = s * gamma[c];
                        let shift = beta[c] - m * scale;
                        let (mut sdz, mut sdzx) = (0.0f32, 0.0f32);
                        let base = b * inner;
                        for i in 0..inner {
                            let v = xs[base + i].to();
                            let dz = through(dy_at(base + i), v * scale + shift, act);
                            sdz += dz;
                            sdzx += dz * (v - m) * s;
                        }
                        (sdz, sdzx)
                    })
                    .collect();
                (sums, Vec::new())
            }
        };

        // Affine gradients.
        let (dgamma, dbeta) = if wanted.affine {
            let mut dgamma = vec![0.0f32; affine];
            let mut dbeta = vec![0.0f32; affine];
            match grouping {
                Grouping::PerRow => {
                    for (i, (sdz, sdzx)) in feature_sums.iter().enumerate() {
                        dbeta[i] = *sdz as f32;
                        dgamma[i] = *sdzx as f32;
                    }
                }
                _ => {
                    let mut acc = vec![(0.0f64, 0.0f64); affine];
                    for (b, (sdz, sdzx)) in block_sums.iter().enumerate() {
                        let c = b % view.channels;
                        acc[c].0 += *sdz as f64;
                        acc[c].1 += *sdzx as f64;
                    }
                    for (c, (sdz, sdzx)) in acc.into_iter().enumerate() {
                        dbeta[c] = sdz as f32;
                        dgamma[c] = sdzx as f32;
                    }
                }
            }
            (Some(f32_tensor(dgamma)), Some(f32_tensor(dbeta)))
        } else {
            (None, None)
        };

        if !wanted.input {
            return (None, dgamma, dbeta);
        }

        // Group sums of g = dz * gamma and g * xhat, as means.
        let mut mg = vec![0.0f64; groups];
        let mut mgx = vec![0.0f64; groups];
        if wanted.batch_stats {
            for (b, (a, bx)) in block_sums.iter().enumerate() {
                let g = block_group(view, grouping, b);
                let factor = match grouping {
                    Grouping::PerRow => 1.0,
                    _ => gamma[b % view.channels],
                };
                mg[g] += (*a * factor) as f64;
                mgx[g] += (*bx * factor) as f64;
            }
        }
        let mg: Vec<f32> = mg.iter().map(|v| (*v / size as f64) as f32).collect();
        let mgx: Vec<f32> = mgx.iter().map(|v| (*v / size as f64) as f32).collect();

        // Pass 2: dx = invstd * (g - mean(g) - xhat * mean(g * xhat)).
        let mut dx = vec![E::of(0.0); xs.len()];
        dx.par_chunks_mut(inner).enumerate().for_each(|(b, out)| {
            let g = block_group(view, grouping, b);
            let (m, s) = (mean[g], invstd[g]);
            let (a, ax) = (mg[g], mgx[g]);
            let base = b * inner;
            match block_affine(view, grouping, b) {
                Affine::Channel(c) => {
                    let scale = s * gamma[c];
                    let shift = beta[c] - m * scale;
                    for (i, o) in out.iter_mut().enumerate() {
                        let v = xs[base + i].to();
                        let dz = through(dy_at(base + i), v * scale + shift, act);
                        let xhat = (v - m) * s;
                        *o = E::of(s * (dz * gamma[c] - a - xhat * ax));
                    }
                }
                Affine::PerElement => {
                    for (i, o) in out.iter_mut().enumerate() {
                        let v = xs[base + i].to();
                        let xhat = (v - m) * s;
                        let dz = through(dy_at(base + i), xhat * gamma[i] + beta[i], act);
                        *o = E::of(s * (dz * gamma[i] - a - xhat * ax));
                    }
                }
            }
        });
        (Some(tensor(dx, shape)), dgamma, dbeta)
    })
}

/// [`super::LeanBackend::quantize_blocks`] on Flex: one pass per block, in parallel; the same
/// arithmetic as the tensor ops (`x / absmax`, the largest map value not above it, rounded up
/// where the next one is at most as far), so the same codes.
pub(super) fn quantize_blocks(x: &T, map: &[f32], block: usize) -> Option<(FlexTensor, T)> {
    let x = contiguous(x);
    if x.dtype() != DType::F32 || block == 0 || map.len() != 256 {
        return None;
    }
    let data = x.as_slice::<f32>()?;
    if data.len() % block != 0 {
        return None;
    }
    let blocks = data.len() / block;
    let mut codes = vec![0u8; data.len()];
    let mut absmax = vec![0f32; blocks];
    codes
        .par_chunks_mut(block)
        .zip(absmax.par_iter_mut())
        .zip(data.par_chunks(block))
        .for_each(|((codes, absmax), values)| {
            let scale = values.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-12);
            *absmax = scale;
            for (code, value) in codes.iter_mut().zip(values) {
                let scaled = value / scale;
                let low = map.partition_point(|m| *m <= scaled).saturating_sub(1);
                let high = (low + 1).min(255);
                let up = scaled - map[low] >= (map[high] - map[low]) * 0.5;
                *code = if up { high as u8 } else { low as u8 };
            }
        });
    let codes = FlexTensor::from_data(TensorData::new(codes, Shape::from(vec![data.len()])));
    Some((codes, f32_tensor(absmax)))
}

/// [`super::LeanBackend::dequantize_blocks`] on Flex.
pub(super) fn dequantize_blocks(
    codes: &FlexTensor,
    absmax: &T,
    map: &[f32],
    block: usize,
) -> Option<T> {
    let (codes, absmax) = (contiguous(codes), contiguous(absmax));
    if codes.dtype() != DType::U8 || absmax.dtype() != DType::F32 || map.len() != 256 {
        return None;
    }
    let (codes, scales) = (codes.as_slice::<u8>()?, absmax.as_slice::<f32>()?);
    if block == 0 || codes.len() != scales.len() * block {
        return None;
    }
    let mut values = vec![0f32; codes.len()];
    values
        .par_chunks_mut(block)
        .zip(codes.par_chunks(block))
        .zip(scales.par_iter())
        .for_each(|((values, codes), scale)| {
            for (value, code) in values.iter_mut().zip(codes) {
                *value = map[*code as usize] * scale;
            }
        });
    Some(f32_tensor(values))
}
