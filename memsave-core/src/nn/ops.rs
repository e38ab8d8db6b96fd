//! The autodiff operations under memsave's layers: a normalisation (BatchNorm, GroupNorm,
//! LayerNorm, optionally with its ReLU) and a ReLU, each one node of Burn's graph with a
//! hand-written backward that keeps only what it needs.
//!
//! | op | keeps for backward | Burn's composed version keeps |
//! |---|---|---|
//! | normalisation (+ ReLU) | its input, and fp32 mean and 1/std per group | a transposed copy of the input, the centred input, the normalised input, the pre-ReLU output |
//! | ReLU | its output (which its consumer, a convolution, keeps anyway) | its input |
//!
//! A normalisation's input is usually a convolution's output, which nothing else keeps; its
//! output goes to a ReLU (fused here: its mask is recomputed from the input in backward), whose
//! output is the next convolution's input. So a conv-norm-ReLU keeps two activation-sized
//! tensors, as PyTorch's (whose ReLU runs in place), where Burn's composition keeps five.
//!
//! The ops run on `Autodiff<Flex>` (fused loops, [`super::kernels`]) and `Autodiff<Cuda>`
//! (tensor ops), found at run time from the tensor's type so that layers stay generic over any
//! `B: Backend`; on any other backend the same arithmetic runs as tensor ops that Burn's autodiff
//! differentiates.

use std::any::{Any, TypeId};
use std::fmt;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::prelude::{Backend, Tensor};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps, ModuleOps};
use burn::tensor::TensorMetadata;
use burn::tensor::TensorPrimitive;

use super::kernels::{generic, Act, ConvKernels, Grouping, NormKernels, View, Wanted};

/// The statistics a normalisation uses.
pub(crate) enum Statistics<B: Backend> {
    /// Those of this input (training BatchNorm, GroupNorm, LayerNorm).
    Batch,
    /// Given ones, constants (BatchNorm in eval mode): mean and biased variance, `[groups]`.
    Running {
        mean: FloatTensor<B>,
        var: FloatTensor<B>,
    },
}

/// A normalisation's output, and the batch statistics when it computed them (fp32, untracked:
/// for running averages).
pub(crate) struct Normalised<B: Backend> {
    pub output: FloatTensor<B>,
    pub batch_stats: Option<(FloatTensor<B>, FloatTensor<B>)>,
}

/// The normalisation: `act((x - mean) / sqrt(var + eps) * gamma + beta)`, statistics per group
/// of `grouping` over `view`, in fp32 whatever `x`'s float type, output in `x`'s type.
#[allow(clippy::too_many_arguments)]
pub(crate) fn normalise<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    statistics: Statistics<B>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<B> {
    macro_rules! on {
        ($backend:ty, $run:ident, $kernels:ty) => {
            if same::<B, $backend>() {
                let statistics = match statistics {
                    Statistics::Batch => Statistics::Batch,
                    Statistics::Running { mean, var } => Statistics::Running {
                        mean: retype(mean),
                        var: retype(var),
                    },
                };
                let out = $run::<$kernels>(
                    retype(x),
                    retype(gamma),
                    retype(beta),
                    statistics,
                    view,
                    grouping,
                    act,
                    epsilon,
                );
                return Normalised {
                    output: retype(out.output),
                    batch_stats: out.batch_stats.map(|(m, v)| (retype(m), retype(v))),
                };
            }
        };
    }
    on!(Autodiff<Flex>, tracked, Flex);
    on!(Flex, untracked, Flex);
    #[cfg(feature = "cuda")]
    {
        on!(Autodiff<burn::backend::Cuda>, tracked, burn::backend::Cuda);
        on!(burn::backend::Cuda, untracked, burn::backend::Cuda);
    }
    // Any other backend: tensor ops, differentiated by Burn if it is an autodiff backend.
    composed::<B>(x, gamma, beta, statistics, view, grouping, act, epsilon)
}

/// A ReLU that keeps its output for backward (Burn's keeps its input): the output is what the
/// next layer keeps anyway, so the ReLU itself costs no memory.
pub(crate) fn relu<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    if same::<B, Autodiff<Flex>>() {
        return retype(relu_keeping_output::<Flex>(retype(x)));
    }
    #[cfg(feature = "cuda")]
    if same::<B, Autodiff<burn::backend::Cuda>>() {
        return retype(relu_keeping_output::<burn::backend::Cuda>(retype(x)));
    }
    B::relu(x)
}

/// `conv2d(x, weight, bias)` whose backward computes the weight gradient with
/// [`ConvKernels::conv2d_weight_grad`] (on Flex: contiguous, exactly the weight's size, without
/// the strided copies of Burn's default).
pub(crate) fn conv2d<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
) -> FloatTensor<B> {
    if same::<B, Autodiff<Flex>>() {
        return retype(tracked_conv2d::<Flex>(
            retype(x),
            retype(weight),
            bias.map(retype),
            options,
        ));
    }
    #[cfg(feature = "cuda")]
    if same::<B, Autodiff<burn::backend::Cuda>>() {
        return retype(tracked_conv2d::<burn::backend::Cuda>(
            retype(x),
            retype(weight),
            bias.map(retype),
            options,
        ));
    }
    B::conv2d(x, weight, bias, options)
}

/// `max_pool2d(x)` that keeps only the maxima's indices and the input's shape for backward (on
/// `Autodiff<Flex>`, whose backward reads nothing else of the input).
pub(crate) fn max_pool2d<B: Backend>(
    x: FloatTensor<B>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
) -> FloatTensor<B> {
    if same::<B, Autodiff<Flex>>() {
        let options = PoolOptions {
            kernel,
            stride,
            padding,
            dilation,
            ceil_mode,
        };
        return retype(tracked_max_pool2d(retype(x), options));
    }
    B::max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
}

// ---------------------------------------------------------------------------------------------
// Dispatch on the backend's type.

/// Whether `B` and `T` have the same float tensors (`Autodiff<K, C>` for any strategy `C` is
/// `Autodiff<K>` here: the strategy only matters to memory-bound ops, and these are not).
fn same<B: Backend, T: Backend>() -> bool {
    TypeId::of::<FloatTensor<B>>() == TypeId::of::<FloatTensor<T>>()
}

/// A tensor of `F` as one of `T`, after [`same`] said they are one type.
fn retype<F: 'static, T: 'static>(value: F) -> T {
    let boxed: Box<dyn Any> = Box::new(value);
    *boxed
        .downcast::<T>()
        .ok()
        .expect("`same` checked that the types are equal")
}

// ---------------------------------------------------------------------------------------------
// Implementations.

fn inv_std<K: Backend>(var: FloatTensor<K>, epsilon: f64) -> FloatTensor<K> {
    let var = Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(var));
    var.add_scalar(epsilon)
        .sqrt()
        .recip()
        .into_primitive()
        .tensor()
}

/// Without autodiff: statistics, then the output.
#[allow(clippy::too_many_arguments)]
fn untracked<K: NormKernels>(
    x: FloatTensor<K>,
    gamma: FloatTensor<K>,
    beta: FloatTensor<K>,
    statistics: Statistics<K>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<K> {
    let (mean, var, batch) = match statistics {
        Statistics::Batch => {
            let (mean, var) = K::norm_stats(&x, view, grouping);
            (mean, var, true)
        }
        Statistics::Running { mean, var } => (mean, var, false),
    };
    let invstd = inv_std::<K>(var.clone(), epsilon);
    let output = K::norm_apply(x, view, grouping, &mean, &invstd, &gamma, &beta, act);
    Normalised {
        output,
        batch_stats: batch.then_some((mean, var)),
    }
}

/// On `Autodiff<K>`: one node, whose backward is [`NormKernels::norm_backward`].
#[allow(clippy::too_many_arguments)]
fn tracked<K: NormKernels>(
    x: FloatTensor<Autodiff<K>>,
    gamma: FloatTensor<Autodiff<K>>,
    beta: FloatTensor<Autodiff<K>>,
    statistics: Statistics<Autodiff<K>>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<Autodiff<K>> {
    let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
    let (xi, gi, bi) = (inner(x.clone()), inner(gamma.clone()), inner(beta.clone()));
    let (mean, var, batch) = match statistics {
        Statistics::Batch => {
            let (mean, var) = K::norm_stats(&xi, view, grouping);
            (mean, var, true)
        }
        Statistics::Running { mean, var } => (inner(mean), inner(var), false),
    };
    let invstd = inv_std::<K>(var.clone(), epsilon);
    let output = K::norm_apply(xi.clone(), view, grouping, &mean, &invstd, &gi, &bi, act);
    let nodes = [x.node.clone(), gamma.node.clone(), beta.node.clone()];
    let output = match NormBackward
        .prepare::<NoCheckpointing>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            NormState {
                x: xi,
                mean: mean.clone(),
                invstd,
                gamma: gi,
                beta: bi,
                view,
                grouping,
                act,
                batch,
            },
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    let from_inner = |t: FloatTensor<K>| Autodiff::<K>::from_inner(t);
    Normalised {
        output,
        batch_stats: batch.then(|| (from_inner(mean), from_inner(var))),
    }
}

/// Any other backend: the same arithmetic as tensor ops.
#[allow(clippy::too_many_arguments)]
fn composed<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    statistics: Statistics<B>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
) -> Normalised<B> {
    let (mean, var, batch) = match statistics {
        Statistics::Batch => {
            let (mean, var) = generic::stats::<B>(&x, view, grouping);
            (mean, var, true)
        }
        Statistics::Running { mean, var } => (mean, var, false),
    };
    let invstd = inv_std::<B>(var.clone(), epsilon);
    let output = generic::apply::<B>(x, view, grouping, &mean, &invstd, &gamma, &beta, act);
    let detach = |t: FloatTensor<B>| {
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t))
            .detach()
            .into_primitive()
            .tensor()
    };
    Normalised {
        output,
        batch_stats: batch.then(|| (detach(mean), detach(var))),
    }
}

#[derive(Clone)]
struct NormState<K: Backend> {
    x: FloatTensor<K>,
    mean: FloatTensor<K>,
    invstd: FloatTensor<K>,
    gamma: FloatTensor<K>,
    beta: FloatTensor<K>,
    view: View,
    grouping: Grouping,
    act: Act,
    batch: bool,
}

impl<K: Backend> fmt::Debug for NormState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NormState({:?}, {:?}, {:?})",
            self.view, self.grouping, self.act
        )
    }
}

#[derive(Debug)]
struct NormBackward;

impl<K: NormKernels> Backward<K, 3> for NormBackward {
    type State = NormState<K>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pg, pb] = ops.parents;
        let dy = grads.consume::<K>(&ops.node);
        let s = ops.state;
        let wanted = Wanted {
            input: px.is_some(),
            affine: pg.is_some() || pb.is_some(),
            batch_stats: s.batch,
        };
        let (dx, dgamma, dbeta) = K::norm_backward(
            &s.x, dy, s.view, s.grouping, &s.mean, &s.invstd, &s.gamma, &s.beta, s.act, wanted,
        );
        if let (Some(node), Some(dx)) = (px, dx) {
            grads.register::<K>(node.id, dx);
        }
        if let (Some(node), Some(dgamma)) = (pg, dgamma) {
            grads.register::<K>(node.id, dgamma);
        }
        if let (Some(node), Some(dbeta)) = (pb, dbeta) {
            grads.register::<K>(node.id, dbeta);
        }
    }
}

fn relu_keeping_output<K: Backend>(x: FloatTensor<Autodiff<K>>) -> FloatTensor<Autodiff<K>> {
    let output = K::relu(Autodiff::<K>::inner(x.clone()));
    match ReluBackward
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(Output(output.clone()), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

#[derive(Clone)]
struct Output<K: Backend>(FloatTensor<K>);

impl<K: Backend> fmt::Debug for Output<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReluOutput")
    }
}

#[derive(Debug)]
struct ReluBackward;

impl<K: Backend> Backward<K, 1> for ReluBackward {
    type State = Output<K>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<K>(&ops.node);
        if let Some(parent) = parent {
            // `output > 0` is `input > 0`: the mask from the output is the same.
            grads.register::<K>(parent.id, K::relu_backward(ops.state.0, grad));
        }
    }
}

fn tracked_conv2d<K: ConvKernels>(
    x: FloatTensor<Autodiff<K>>,
    weight: FloatTensor<Autodiff<K>>,
    bias: Option<FloatTensor<Autodiff<K>>>,
    options: ConvOptions<2>,
) -> FloatTensor<Autodiff<K>> {
    let inner = |t: FloatTensor<Autodiff<K>>| Autodiff::<K>::inner(t);
    let (xi, wi) = (inner(x.clone()), inner(weight.clone()));
    let output = K::conv2d(
        xi.clone(),
        wi.clone(),
        bias.clone().map(inner),
        options.clone(),
    );
    // Without a bias, an untracked leaf stands in its place: no gradient goes there.
    let bias_node = match &bias {
        Some(bias) => bias.node.clone(),
        None => Autodiff::<K>::from_inner(super::kernels::generic::scalar_like::<K>(&wi)).node,
    };
    match Conv2dBackward
        .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone(), bias_node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            ConvState {
                x: xi,
                weight: wi,
                options,
            },
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

#[derive(Clone)]
struct ConvState<K: Backend> {
    x: FloatTensor<K>,
    weight: FloatTensor<K>,
    options: ConvOptions<2>,
}

impl<K: Backend> fmt::Debug for ConvState<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConvState({:?})", self.options)
    }
}

#[derive(Debug)]
struct Conv2dBackward;

impl<K: ConvKernels> Backward<K, 3> for Conv2dBackward {
    type State = ConvState<K>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let dy = grads.consume::<K>(&ops.node);
        let ConvState { x, weight, options } = ops.state;
        if let Some(node) = pb {
            let dy = Tensor::<K, 4>::from_primitive(TensorPrimitive::Float(dy.clone()));
            let channels = dy.dims()[1];
            let db = dy.sum_dim(0).sum_dim(2).sum_dim(3).reshape([channels]);
            grads.register::<K>(node.id, db.into_primitive().tensor());
        }
        // The input gradient first: its temporaries are gone before the weight gradient exists.
        if let Some(node) = px {
            let dx = K::conv2d_x_backward(x.clone(), weight.clone(), dy.clone(), options.clone());
            grads.register::<K>(node.id, dx);
        }
        if let Some(node) = pw {
            grads.register::<K>(node.id, K::conv2d_weight_grad(x, weight, dy, options));
        }
    }
}

#[derive(Clone, Debug)]
struct PoolOptions {
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
}

fn tracked_max_pool2d(
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
struct PoolState {
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
struct MaxPoolBackward;

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
