//! The trainable parameters without a gradient (MMCV's `detect_anomalous_params`).

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

/// The module paths of the trainable parameters that have no gradient (MMCV's
/// `detect_anomalous_params`).
pub(crate) fn params_without_grad<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<String> {
    struct Present<'a> {
        grads: &'a GradientsParams,
        ids: std::collections::HashSet<burn::module::ParamId>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Present<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.grads.get::<B::InnerBackend, D>(param.id).is_some() {
                self.ids.insert(param.id);
            }
        }
    }
    let mut present = Present {
        grads,
        ids: Default::default(),
    };
    model.visit(&mut present);
    params_without::<B, M>(model, &|id| present.ids.contains(&id))
}

/// The module paths of the trainable parameters for which `has` is false.
pub(crate) fn params_without<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    has: &dyn Fn(burn::module::ParamId) -> bool,
) -> Vec<String> {
    struct Find<'a> {
        has: &'a dyn Fn(burn::module::ParamId) -> bool,
        path: Vec<String>,
        missing: Vec<String>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Find<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let trainable = param.val().is_require_grad();
            if trainable && !(self.has)(param.id) {
                self.missing.push(self.path.join("."));
            }
        }
    }
    let mut find = Find {
        has,
        path: Vec::new(),
        missing: Vec::new(),
    };
    model.visit(&mut find);
    find.missing
}
