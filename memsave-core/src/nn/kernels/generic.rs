//! [`NormKernels`](super::NormKernels) with tensor ops, for any backend (CUDA among them). Each
//! function keeps no more than one activation-sized temporary beyond its inputs and output.

use burn::prelude::{Backend, Tensor};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata, TensorPrimitive};

use super::{Act, Grouping, View, Wanted};

fn wrap<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `t`, of any rank, as `shape`.
fn view_as<B: Backend>(t: FloatTensor<B>, shape: [usize; 3]) -> Tensor<B, 3> {
    wrap(B::float_reshape(t, Shape::new(shape)))
}

fn unwrap<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
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

fn group_stat<B: Backend>(stat: &FloatTensor<B>) -> Tensor<B, 3> {
    let stat = wrap::<B, 1>(stat.clone());
    let len = stat.dims()[0];
    stat.reshape([1, len, 1])
}

/// Sum over dims 0 and 2 of `[A, G, B]`, as `[G]`.
fn sum_0_2<B: Backend>(t: Tensor<B, 3>) -> Tensor<B, 1> {
    let g = t.dims()[1];
    t.sum_dim(2).sum_dim(0).reshape([g])
}

/// The mean and biased variance of `x` per group of `grouping` (fp32, `[G]` each), in tensor
/// ops.
pub fn stats<B: Backend>(
    x: &FloatTensor<B>,
    view: View,
    grouping: Grouping,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let size = view.group_size(grouping) as f64;
    let x = view_as::<B>(x.clone(), group_view(view, grouping)).cast(DType::F32);
    let mean = sum_0_2(x.clone()).div_scalar(size);
    let g = mean.dims()[0];
    let centred = x - mean.clone().reshape([1, g, 1]);
    let var = sum_0_2(centred.square()).div_scalar(size);
    (unwrap(mean), unwrap(var))
}

/// `act((x - mean) * invstd * gamma + beta)` per group, in `x`'s dtype (the norm's forward),
/// in tensor ops.
#[allow(clippy::too_many_arguments)]
pub fn apply<B: Backend>(
    x: FloatTensor<B>,
    view: View,
    grouping: Grouping,
    mean: &FloatTensor<B>,
    invstd: &FloatTensor<B>,
    gamma: &FloatTensor<B>,
    beta: &FloatTensor<B>,
    act: Act,
) -> FloatTensor<B> {
    let (dtype, shape) = (x.dtype(), x.shape());
    let xhat = (view_as::<B>(x, group_view(view, grouping)).cast(DType::F32)
        - group_stat::<B>(mean))
        * group_stat::<B>(invstd);
    let (av, ps) = affine_view(view, grouping);
    let z = xhat.reshape(av) * wrap::<B, 1>(gamma.clone()).cast(DType::F32).reshape(ps)
        + wrap::<B, 1>(beta.clone()).cast(DType::F32).reshape(ps);
    let y = match act {
        Act::Identity => z,
        Act::Relu => burn::tensor::activation::relu(z),
    };
    B::float_reshape(unwrap(y.cast(dtype)), shape)
}

/// The norm's input, gamma and beta gradients from `dy` (the activation's mask applied), in
/// tensor ops.
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    x: &FloatTensor<B>,
    dy: FloatTensor<B>,
    view: View,
    grouping: Grouping,
    mean: &FloatTensor<B>,
    invstd: &FloatTensor<B>,
    gamma: &FloatTensor<B>,
    beta: &FloatTensor<B>,
    act: Act,
    wanted: Wanted,
) -> (
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
) {
    let size = view.group_size(grouping) as f64;
    let (dtype, shape) = (x.dtype(), x.shape());
    let gv = group_view(view, grouping);
    let (av, ps) = affine_view(view, grouping);
    let gamma = wrap::<B, 1>(gamma.clone()).cast(DType::F32);
    let beta = wrap::<B, 1>(beta.clone()).cast(DType::F32);
    let xhat = ((view_as::<B>(x.clone(), gv).cast(DType::F32) - group_stat::<B>(mean))
        * group_stat::<B>(invstd))
    .reshape(av);
    let dy = view_as::<B>(dy, av).cast(DType::F32);
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
        (Some(unwrap(dg)), Some(unwrap(db)))
    } else {
        (None, None)
    };
    if !wanted.input {
        return (None, dgamma, dbeta);
    }
    let g = (dz * gamma.reshape(ps)).reshape(gv);
    let xhat = xhat.reshape(gv);
    let invstd = group_stat::<B>(invstd);
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
    (
        Some(B::float_reshape(unwrap(dx.cast(dtype)), shape)),
        dgamma,
        dbeta,
    )
}

/// A one-element fp32 zero on the device of `like`.
pub(crate) fn scalar_like<B: Backend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(
        Shape::new([1]),
        &B::float_device(like),
        burn::tensor::FloatDType::F32,
    )
}
