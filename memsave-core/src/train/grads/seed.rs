//! Starting a backward pass from gradient sums: a node over the loss that registers them on
//! the parameters' nodes before any gradient is computed.

use std::any::TypeId;
use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// `loss + 0` whose backward first registers `sums` on the parameters' nodes (see
/// [`backward`](super::backward)); on a backend without the node, `loss` and `sums` back.
pub(crate) fn seed_with<B: AutodiffBackend, M: AutodiffModule<B>>(
    loss: Tensor<B, 1>,
    model: &M,
    sums: GradientsParams,
) -> (Tensor<B, 1>, Option<GradientsParams>) {
    // Burn's autodiff (any checkpoint strategy) over whatever inner backend: its nodes can be
    // seeded.
    if TypeId::of::<FloatTensor<B>>() == TypeId::of::<FloatTensor<Autodiff<B::InnerBackend>>>() {
        return (seeded::<B, M, B::InnerBackend>(loss, model, sums), None);
    }
    (loss, Some(sums))
}

fn seeded<B: AutodiffBackend, M: AutodiffModule<B>, K: Backend>(
    loss: Tensor<B, 1>,
    model: &M,
    mut sums: GradientsParams,
) -> Tensor<B, 1> {
    // The parameters' nodes in this forward, with their sums (moved out of `sums`).
    struct Take<'a, B: AutodiffBackend, K: Backend> {
        sums: &'a mut GradientsParams,
        seeds: Vec<(NodeId, FloatTensor<K>)>,
        _backend: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend, K: Backend> ModuleVisitor<B> for Take<'_, B, K> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(sum) = self.sums.remove::<B::InnerBackend, D>(param.id) else {
                return;
            };
            let node = cast::<FloatTensor<B>, FloatTensor<Autodiff<K>>>(
                param.val().into_primitive().tensor(),
            )
            .node
            .id;
            let sum =
                cast::<FloatTensor<B::InnerBackend>, FloatTensor<K>>(sum.into_primitive().tensor());
            self.seeds.push((node, sum));
        }
    }
    let mut take = Take::<B, K> {
        sums: &mut sums,
        seeds: Vec::new(),
        _backend: std::marker::PhantomData,
    };
    model.visit(&mut take);
    let seeds = take.seeds;
    let loss_primitive =
        cast::<FloatTensor<B>, FloatTensor<Autodiff<K>>>(loss.clone().into_primitive().tensor());
    let zero = Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(Autodiff::<K>::inner(
        loss_primitive.clone(),
    )))
    .zeros_like()
    .into_primitive()
    .tensor();
    let seed = match Seed
        .prepare::<NoCheckpointing>([loss_primitive.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(Seeds(Arc::new(Mutex::new(seeds))), zero),
        OpsKind::UnTracked(prep) => prep.finish(zero),
    };
    let seed = cast::<FloatTensor<Autodiff<K>>, FloatTensor<B>>(seed);
    loss + Tensor::from_primitive(TensorPrimitive::Float(seed))
}

fn cast<F: 'static, T: 'static>(value: F) -> T {
    let boxed: Box<dyn std::any::Any> = Box::new(value);
    *boxed
        .downcast::<T>()
        .ok()
        .expect("the backend's tensors were checked to be these")
}

/// The gradient sums, registered once by the first step of the backward pass.
#[derive(Clone)]
struct Seeds<K: Backend>(Arc<Mutex<Vec<(NodeId, FloatTensor<K>)>>>);

impl<K: Backend> fmt::Debug for Seeds<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Seeds")
    }
}

/// A node over the loss, one depth above it: its step runs before any gradient is computed.
/// It registers the sums on the parameters' nodes, passes nothing to the loss (its value is 0),
/// and frees them from itself: from then on each sum lives in the gradients container only.
#[derive(Debug)]
struct Seed;

impl<K: Backend> Backward<K, 1> for Seed {
    type State = Seeds<K>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let _ = grads.consume::<K>(&ops.node);
        let seeds = std::mem::take(
            &mut *ops
                .state
                .0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for (node, sum) in seeds {
            grads.register::<K>(node, sum);
        }
    }
}
