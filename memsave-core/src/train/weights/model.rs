//! The 16-bit weights of a model around a step on a group of its parameters: widened to fp32
//! for the optimizer (that group only), rounded back after it.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};

use super::WeightStore;

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// `model` with the 16-bit parameters that have a gradient in `group` widened to fp32 (new
/// leaves, `require_grad` kept), and their 16-bit values by id.
pub(crate) fn widen<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: M,
    group: &GradientsParams,
) -> (M, HashMap<ParamId, FloatTensor<Inner<B>>>) {
    struct Widen<'a, B: AutodiffBackend> {
        group: &'a GradientsParams,
        old: HashMap<ParamId, FloatTensor<Inner<B>>>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Widen<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let id = param.id;
            if self.group.get::<Inner<B>, D>(id).is_none() {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            if tensor.dtype() == DType::F32 {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let require_grad = tensor.is_require_grad();
            let inner = tensor.inner();
            let mut wide = Tensor::<B, D>::from_inner(inner.clone().cast(DType::F32));
            if require_grad {
                wide = wide.require_grad();
            }
            self.old.insert(id, inner.into_primitive().tensor());
            Param::from_mapped_value(id, wide, mapper)
        }
    }
    let mut widen = Widen::<B> {
        group,
        old: HashMap::new(),
    };
    let model = model.map(&mut widen);
    (model, widen.old)
}

/// `model` with each parameter of `old` (its 16-bit value before the step) rounded back to 16
/// bits from its stepped fp32 value, by `store`'s rounding.
pub(crate) fn narrow<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: M,
    mut old: HashMap<ParamId, FloatTensor<Inner<B>>>,
    store: &mut WeightStore<Inner<B>>,
) -> M {
    struct Narrow<'a, B: AutodiffBackend> {
        old: &'a mut HashMap<ParamId, FloatTensor<Inner<B>>>,
        store: &'a mut WeightStore<Inner<B>>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Narrow<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let Some(before) = self.old.remove(&param.id) else {
                return param;
            };
            let (id, tensor, mapper) = param.consume();
            let require_grad = tensor.is_require_grad();
            let before = Tensor::<Inner<B>, D>::from_primitive(TensorPrimitive::Float(before));
            let stored = self.store.narrow(id, before, tensor.inner());
            let mut narrow = Tensor::<B, D>::from_inner(stored);
            if require_grad {
                narrow = narrow.require_grad();
            }
            Param::from_mapped_value(id, narrow, mapper)
        }
    }
    model.map(&mut Narrow::<B> {
        old: &mut old,
        store,
    })
}
