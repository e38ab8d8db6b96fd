//! A normalisation's arithmetic as tensor ops on plain (non-autodiff) tensors: the statistics,
//! the output, and the backward from the input and the statistics alone. Each function keeps no
//! more than one activation-sized temporary beyond its inputs and output; statistics and
//! arithmetic in fp32 whatever the input's float type.

use burn::prelude::*;
use burn::tensor::DType;

use super::view::{Act, Grouping, View, Wanted};

/// `t`, of any rank, as `shape`.
fn view_as<const D: usize>(t: Tensor<D>, shape: [usize; 3]) -> Tensor<3> {
    t.reshape(shape)
}

/// `[A, G, B]`: statistics over dims 0 and 2, one per `G`.
fn group_view(view: View, grouping: Grouping) -> [usize; 3] {
    match grouping {
        Grouping::PerChannel => [view.outer, view.channels, view.inner],
        Grouping::PerSampleGroup { groups } => {
            [1, view.outer * groups, view.channels / groups * view.inner]
        }
        Grouping::PerRow => [1, view.outer, view.inner],
    }
}

/// `[P, Q, R]` and the shape the affine parameters broadcast as.
fn affine_view(view: View, grouping: Grouping) -> ([usize; 3], [usize; 3]) {
    match grouping {
        Grouping::PerRow => ([view.outer, 1, view.inner], [1, 1, view.inner]),
        _ => (
            [view.outer, view.channels, view.inner],
            [1, view.channels, 1],
        ),
    }
}

fn group_stat(stat: &Tensor<1>) -> Tensor<3> {
    let len = stat.dims()[0];
    stat.clone().reshape([1, len, 1])
}

/// Sum over dims 0 and 2 of `[A, G, B]`, as `[G]`.
fn sum_0_2(t: Tensor<3>) -> Tensor<1> {
    let g = t.dims()[1];
    t.sum_dim(2).sum_dim(0).reshape([g])
}

/// The mean and biased variance of `x` per group of `grouping` (fp32, `[G]` each).
pub(crate) fn stats<const D: usize>(
    x: &Tensor<D>,
    view: View,
    grouping: Grouping,
) -> (Tensor<1>, Tensor<1>) {
    let size = view.group_size(grouping) as f64;
    let x = view_as(x.clone(), group_view(view, grouping)).cast(DType::F32);
    let mean = sum_0_2(x.clone()).div_scalar(size);
    let g = mean.dims()[0];
    let centred = x - mean.clone().reshape([1, g, 1]);
    let var = sum_0_2(centred.square()).div_scalar(size);
    (mean, var)
}

/// `1 / sqrt(var + epsilon)`.
pub(crate) fn inv_std(var: Tensor<1>, epsilon: f64) -> Tensor<1> {
    var.add_scalar(epsilon).sqrt().recip()
}

/// `act((x - mean) * invstd * gamma + beta)` per group, in `x`'s dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply<const D: usize>(
    x: Tensor<D>,
    view: View,
    grouping: Grouping,
    mean: &Tensor<1>,
    invstd: &Tensor<1>,
    gamma: &Tensor<1>,
    beta: &Tensor<1>,
    act: Act,
) -> Tensor<D> {
    let (dtype, shape) = (x.dtype(), x.shape());
    let xhat = (view_as(x, group_view(view, grouping)).cast(DType::F32) - group_stat(mean))
        * group_stat(invstd);
    let (av, ps) = affine_view(view, grouping);
    let z = xhat.reshape(av) * gamma.clone().cast(DType::F32).reshape(ps)
        + beta.clone().cast(DType::F32).reshape(ps);
    let y = match act {
        Act::Identity => z,
        Act::Relu => burn::tensor::activation::relu(z),
    };
    y.cast(dtype).reshape(shape)
}

/// The input's, gamma's and beta's gradients from `dy` (the activation's mask applied; `None`
/// where not `wanted`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<const D: usize>(
    x: &Tensor<D>,
    dy: Tensor<D>,
    view: View,
    grouping: Grouping,
    mean: &Tensor<1>,
    invstd: &Tensor<1>,
    gamma: &Tensor<1>,
    beta: &Tensor<1>,
    act: Act,
    wanted: Wanted,
) -> (Option<Tensor<D>>, Option<Tensor<1>>, Option<Tensor<1>>) {
    let size = view.group_size(grouping) as f64;
    let (dtype, shape) = (x.dtype(), x.shape());
    let gv = group_view(view, grouping);
    let (av, ps) = affine_view(view, grouping);
    let gamma = gamma.clone().cast(DType::F32);
    let beta = beta.clone().cast(DType::F32);
    let xhat = ((view_as(x.clone(), gv).cast(DType::F32) - group_stat(mean)) * group_stat(invstd))
        .reshape(av);
    let dy = view_as(dy, av).cast(DType::F32);
    let dz = match act {
        Act::Identity => dy,
        Act::Relu => {
            let z = xhat.clone() * gamma.clone().reshape(ps) + beta.reshape(ps);
            dy.mask_fill(z.lower_equal_elem(0.0), 0.0)
        }
    };
    let (dgamma, dbeta) = if wanted.affine {
        let (dg, db) = match grouping {
            Grouping::PerRow => {
                let f = view.inner;
                (
                    (dz.clone() * xhat.clone())
                        .sum_dim(0)
                        .sum_dim(1)
                        .reshape([f]),
                    dz.clone().sum_dim(0).sum_dim(1).reshape([f]),
                )
            }
            _ => (sum_0_2(dz.clone() * xhat.clone()), sum_0_2(dz.clone())),
        };
        (Some(dg), Some(db))
    } else {
        (None, None)
    };
    if !wanted.input {
        return (None, dgamma, dbeta);
    }
    let g = (dz * gamma.reshape(ps)).reshape(gv);
    let xhat = xhat.reshape(gv);
    let invstd = group_stat(invstd);
    let dx = if wanted.batch_stats {
        let groups = gv[1];
        let mg = sum_0_2(g.clone()).div_scalar(size).reshape([1, groups, 1]);
        let mgx = sum_0_2(g.clone() * xhat.clone())
            .div_scalar(size)
            .reshape([1, groups, 1]);
        (g - mg - xhat * mgx) * invstd
    } else {
        g * invstd
    };
    (Some(dx.cast(dtype).reshape(shape)), dgamma, dbeta)
}
