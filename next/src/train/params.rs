//! What the runner and the adapters read of a model's parameters: the first half one, whether
//! it has Burn's BatchNorm, which trainable ones a backward left without a gradient.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

/// Module paths as a visit enters and leaves them.
#[derive(Default)]
struct Path(Vec<String>);

impl Path {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }

    fn exit(&mut self) {
        self.0.pop();
    }

    fn joined(&self) -> String {
        self.0.join(".")
    }
}

/// The name of the first half parameter of `model`, where one is.
pub(crate) fn first_half_param<M: Module>(model: &M) -> Option<String> {
    #[derive(Default)]
    struct Find {
        path: Path,
        found: Option<String>,
    }
    impl ModuleVisitor for Find {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let half = matches!(param.val().dtype(), DType::F16 | DType::BF16);
            if half && self.found.is_none() {
                self.found = Some(self.path.joined());
            }
        }
    }
    let mut find = Find::default();
    model.visit(&mut find);
    find.found
}

/// Whether `model` holds Burn's `BatchNorm` (whose batch statistics see one micro-batch at a
/// time under accumulation).
pub(crate) fn has_batch_norm<M: Module>(model: &M) -> bool {
    struct Find(bool);
    impl ModuleVisitor for Find {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            self.0 |= container_type == "Struct:BatchNorm";
        }
    }
    let mut find = Find(false);
    model.visit(&mut find);
    find.0
}

/// The module paths of `model`'s trainable parameters that have no gradient in `grads` (MMCV's
/// `detect_anomalous_params`).
pub(crate) fn params_without_grad<M: Module>(model: &M, grads: &GradientsParams) -> Vec<String> {
    struct InGrads<'a>(&'a GradientsParams);
    impl HasGrad for InGrads<'_> {
        fn has<const D: usize>(&self, id: ParamId) -> bool {
            self.0.get::<D>(id).is_some()
        }
    }
    params_without(model, &InGrads(grads))
}

/// The module paths of `model`'s trainable parameters that `reached` lacks (the step in
/// backward's taps that ran).
pub(crate) fn params_not_reached<M: Module>(
    model: &M,
    reached: &std::collections::HashSet<ParamId>,
) -> Vec<String> {
    struct Reached<'a>(&'a std::collections::HashSet<ParamId>);
    impl HasGrad for Reached<'_> {
        fn has<const D: usize>(&self, id: ParamId) -> bool {
            self.0.contains(&id)
        }
    }
    params_without(model, &Reached(reached))
}

/// Whether a parameter got a gradient.
trait HasGrad {
    fn has<const D: usize>(&self, id: ParamId) -> bool;
}

fn params_without<M: Module, H: HasGrad>(model: &M, has: &H) -> Vec<String> {
    struct Find<'a, H> {
        has: &'a H,
        path: Path,
        missing: Vec<String>,
    }
    impl<H: HasGrad> ModuleVisitor for Find<'_, H> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.val().is_require_grad() && !self.has.has::<D>(param.id) {
                self.missing.push(self.path.joined());
            }
        }
    }
    let mut find = Find {
        has,
        path: Path::default(),
        missing: Vec::new(),
    };
    model.visit(&mut find);
    find.missing
}

/// The ids of `model`'s parameters that have a gradient in `grads`.
pub(crate) fn ids_with_grad<M: Module>(
    model: &M,
    grads: &GradientsParams,
) -> std::collections::HashSet<ParamId> {
    struct Ids<'a>(&'a GradientsParams, std::collections::HashSet<ParamId>);
    impl ModuleVisitor for Ids<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.get::<D>(param.id).is_some() {
                self.1.insert(param.id);
            }
        }
    }
    let mut ids = Ids(grads, std::collections::HashSet::new());
    model.visit(&mut ids);
    ids.1
}
