//! The backward pass into a set of gradients, and adding one set into another.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use super::seed::seed_with;

/// `backward(loss)` with the parameters' gradients of `model` as [`GradientsParams`], once
/// every recompute thread of the step has ended. When `accumulated` holds gradients of earlier
/// micro-batches (for the same parameters), they are handed to the backward pass as the
/// starting values of the parameters' gradients: each new gradient is added to its sum as it is
/// produced, so that no second full set of gradients ever exists (on Burn's `Autodiff` over any
/// backend, under any checkpoint strategy; elsewhere the two sets are added after the pass).
/// The step's failure, where a segment recorded one ([`crate::checkpoint::join_helpers`]), is
/// the error.
pub fn backward<B: AutodiffBackend, M: AutodiffModule<B>>(
    loss: Tensor<B, 1>,
    model: &M,
    accumulated: Option<GradientsParams>,
) -> crate::Result<GradientsParams> {
    let (loss, leftover) = match accumulated {
        Some(sums) => seed_with::<B, M>(loss, model, sums),
        None => (loss, None),
    };
    let mut grads = GradientsParams::from_grads(loss.backward(), model);
    crate::checkpoint::join_helpers()?;
    if let Some(sums) = leftover {
        let new = std::mem::replace(&mut grads, sums);
        accumulate::<B, M>(model, &mut grads, new);
    }
    Ok(grads)
}

/// `sum += more`, parameter by parameter (a parameter missing on one side keeps the other's;
/// `more`'s gradients are cast to the sum's precision where they differ).
pub fn accumulate<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    sum: &mut GradientsParams,
    mut more: GradientsParams,
) {
    struct Add<'a> {
        sum: &'a mut GradientsParams,
        more: &'a mut GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(grad) = self.more.remove::<B::InnerBackend, D>(param.id) else {
                return;
            };
            let total = add_to_sum(self.sum.remove::<B::InnerBackend, D>(param.id), grad);
            self.sum.register::<B::InnerBackend, D>(param.id, total);
        }
    }
    model.visit(&mut Add {
        sum,
        more: &mut more,
    });
}

/// `previous + grad`, `grad` cast to the sum's precision where they differ (a half gradient is
/// added to an fp32 sum as it is cast, one parameter at a time: no full fp32 copy of the half
/// gradients is made); `grad` alone without a sum.
pub(crate) fn add_to_sum<K: Backend, const D: usize>(
    previous: Option<Tensor<K, D>>,
    grad: Tensor<K, D>,
) -> Tensor<K, D> {
    match previous {
        Some(previous) if previous.dtype() != grad.dtype() => {
            let dtype = previous.dtype();
            previous + grad.cast(dtype)
        }
        Some(previous) => previous + grad,
        None => grad,
    }
}

/// A copy of `grads` (the same tensors, shared), parameter by parameter.
pub(crate) fn share<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> GradientsParams {
    struct Share<'a> {
        grads: &'a GradientsParams,
        copy: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Share<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.copy.register::<B::InnerBackend, D>(param.id, grad);
            }
        }
    }
    let mut share = Share {
        grads,
        copy: GradientsParams::new(),
    };
    model.visit(&mut share);
    share.copy
}
