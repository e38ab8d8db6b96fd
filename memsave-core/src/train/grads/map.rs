//! Operations over every gradient of a set, parameter by parameter: mapping (scaling, casting
//! to fp32) and splitting into groups.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

/// Applies `f` to every gradient of `model`'s parameters, in place.
pub(crate) fn map_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    f: &mut dyn FnMut(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
) {
    struct Map<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        f: &'a mut dyn FnMut(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Map<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let shape = grad.shape();
                let flat: Tensor<B::InnerBackend, 1> = grad.reshape([shape.num_elements()]);
                self.grads
                    .register::<B::InnerBackend, D>(param.id, (self.f)(flat).reshape(shape));
            }
        }
    }
    model.visit(&mut Map::<B> { grads, f });
}

/// `grads` split into groups of parameters, in the model's order, each holding at most about
/// `limit` bytes of gradients counted at 4 bytes an element (one parameter more, when a single
/// one is larger): the optimizer steps a group at a time (see `TrainState::step`). The tensors
/// are moved, not copied.
pub(crate) fn into_chunks<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mut grads: GradientsParams,
    limit: usize,
) -> Vec<GradientsParams> {
    struct Split<'a> {
        grads: &'a mut GradientsParams,
        chunks: Vec<GradientsParams>,
        current: GradientsParams,
        bytes: usize,
        limit: usize,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Split<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
                return;
            };
            self.bytes += grad.shape().num_elements() * 4;
            self.current.register::<B::InnerBackend, D>(param.id, grad);
            if self.bytes >= self.limit {
                self.chunks
                    .push(std::mem::replace(&mut self.current, GradientsParams::new()));
                self.bytes = 0;
            }
        }
    }
    let mut split = Split {
        grads: &mut grads,
        chunks: Vec::new(),
        current: GradientsParams::new(),
        bytes: 0,
        limit,
    };
    model.visit(&mut split);
    let Split {
        mut chunks,
        current,
        ..
    } = split;
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Multiplies every gradient by `factor` (unscaling: `1 / loss_scale`).
pub fn scale<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    map_grads::<B, M>(model, grads, &mut |grad| grad.mul_scalar(factor));
}

/// Casts every gradient to fp32 (half gradients onto the fp32 master weights).
pub(crate) fn to_f32<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
) {
    map_grads::<B, M>(model, grads, &mut |grad| match grad.dtype() {
        DType::F32 => grad,
        _ => grad.cast(DType::F32),
    });
}
