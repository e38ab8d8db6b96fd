//! The step in backward on Burn 0.22 (`OptimizerHook::with_step_in_backward`): each parameter
//! steps as soon as backward has made its final gradient, and the gradient is freed at once, so
//! the whole set of gradients never exists (PyTorch's optimizer hooks in backward, torchtune's
//! `optimizer_in_bwd`, LOMO). The taps are [`crate::train::taps`]'s.
//!
//! Each parameter's step is the ordinary step's arithmetic on the same tensors: the gradient
//! cast to its master's type (fp32 under 16-bit weights) and added to the group's earlier sum,
//! unscaled, clipped by the same factor, stepped by the user's `ModuleOptimizer` (its rule and
//! state, its parameter groups' rates): the same bits. What needs every gradient before any step
//! takes two passes (LOMO's answer): global-norm clipping, and the overflow check of mixed
//! precision and 16-bit weights. The first pass runs the forward and a backward that keeps only
//! each gradient's part of the norm (added in the model's order after backward: the ordinary
//! norm's bits); the second runs the forward again (the runner repeats it with the same batch,
//! the same random draws and the running statistics put back) and a backward that steps. An
//! overflow skips the second pass. Under accumulation, the group's last micro-batch steps in its
//! backward; the earlier ones add up as without.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;

use crate::checkpoint::nodes::lock;
use crate::grads::{self, NormParts};
use crate::train::taps::{DepthChain, Tapper, Untap};
use crate::train::TrainModel;

use super::sink::{Inner, Table};
pub(super) use super::sink::{PassSettings, Phase};

/// How many orders apart the taps of two consecutive parameters are (see
/// [`crate::train::taps`]): more than the ops between two parameters' first uses in the models
/// memsave knows (a convolution, its norm and activation, a residual add, an upsampling).
const TAP_GAP: usize = 24;

/// A pass under way: its sink and the tapped parameters (visiting order).
struct Pass<M> {
    table: Arc<Table<M>>,
    ids: Vec<ParamId>,
}

/// What a finished pass found.
pub(super) struct PassEnd {
    /// The norm of the gradients (unscaled), where kept.
    pub(super) norm: Option<f64>,
    /// The parameters that got a gradient.
    pub(super) reached: HashSet<ParamId>,
}

/// The step in backward's state across iterations: the depth chain and the pass under way.
#[derive(Default)]
pub(super) struct InBackward {
    chain: Option<DepthChain>,
    pass: Option<Box<dyn Any>>,
}

impl std::fmt::Debug for InBackward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InBackward")
            .field("tapped", &self.pass.is_some())
            .finish()
    }
}

impl InBackward {
    /// Taps `forward` (the model the forward runs on) for a pass with `settings`.
    pub(super) fn tap<M: TrainModel>(
        &mut self,
        forward: M,
        device: &Device,
        settings: PassSettings,
    ) -> M {
        let chain = self.chain.get_or_insert_with(|| DepthChain::new(device));
        let table = Arc::new(Table::<M> {
            inner: Mutex::new(Inner {
                settings,
                parts: HashMap::new(),
                reached: HashSet::new(),
                sums: GradientsParams::new(),
                dtypes: HashMap::new(),
                model: None,
                optimizer: None,
                device_model: None,
            }),
        });
        let mut tapper = Tapper::new(chain, TAP_GAP, table.clone());
        let forward = forward.map(&mut tapper);
        let ids = std::mem::take(&mut tapper.ids);
        self.pass = Some(Box::new(Pass { table, ids }));
        forward
    }

    /// Whether a pass is tapped.
    pub(super) fn is_tapped(&self) -> bool {
        self.pass.is_some()
    }

    fn take_pass<M: TrainModel>(&mut self) -> Pass<M> {
        let pass = self.pass.take().expect("a pass was tapped");
        *pass
            .downcast::<Pass<M>>()
            .expect("a pass of the model the hook trains")
    }

    /// The model the pass was tapped on made plain again (the pass given up or done).
    pub(super) fn untap<M: TrainModel>(&mut self, forward: M) -> M {
        match self.pass.take() {
            Some(pass) => {
                let pass = pass
                    .downcast::<Pass<M>>()
                    .expect("a pass of the model the hook trains");
                forward.map(&mut Untap { ids: &pass.ids })
            }
            None => forward,
        }
    }

    /// A norm pass: `backward()` runs the backward of the loss (`sums`: the group's earlier
    /// gradients, added to each new one); `masters` gives the norm's order and each gradient's
    /// dtype. The sums are handed back.
    pub(super) fn norm_pass<M: TrainModel>(
        &mut self,
        masters: &M,
        sums: GradientsParams,
        backward: impl FnOnce(),
    ) -> (PassEnd, GradientsParams) {
        let pass = self.take_pass::<M>();
        {
            let mut inner = lock(&pass.table.inner);
            inner.sums = sums;
            inner.dtypes = dtypes(masters);
        }
        backward();
        let mut guard = lock(&pass.table.inner);
        let inner = &mut *guard;
        let sums = std::mem::take(&mut inner.sums);
        leftover_parts(masters, &sums, inner);
        let norm = norm_of(masters, &mut inner.parts, inner.settings.norm_type);
        let reached = std::mem::take(&mut inner.reached);
        drop(guard);
        // Kept for `untap`.
        self.pass = Some(Box::new(pass));
        (PassEnd { norm, reached }, sums)
    }

    /// An accumulating pass (optimizer offload): `backward()` runs the backward, each gradient
    /// added to the group's sum in `sums` (on the host) as it is final; `masters` gives each
    /// sum's dtype. The sums are handed back.
    pub(super) fn accumulate_pass<M: TrainModel>(
        &mut self,
        masters: &M,
        sums: GradientsParams,
        backward: impl FnOnce(),
    ) -> GradientsParams {
        let pass = self.take_pass::<M>();
        {
            let mut inner = lock(&pass.table.inner);
            inner.sums = sums;
            inner.dtypes = dtypes(masters);
        }
        backward();
        let sums = {
            let mut inner = lock(&pass.table.inner);
            inner.reached.clear();
            std::mem::take(&mut inner.sums)
        };
        self.pass = Some(Box::new(pass));
        sums
    }

    /// A step pass: the masters and the optimizer go into the pass (the masters' tapped weights
    /// replaced in `masters` by one-element placeholders, so that each old weight is freed as
    /// its parameter steps), `backward()` runs the backward, each parameter steps as its tap
    /// runs, and the stepped masters and the optimizer come back. Under optimizer offload,
    /// `host` holds the masters where they are on the host (`masters` is then the device's
    /// model, each weight put up as its master steps); without `host`, `masters` are stepped
    /// where they are (16-bit weights: on the host, each put back on the device).
    pub(super) fn step_pass<M: TrainModel>(
        &mut self,
        masters: &mut M,
        host: Option<&mut Option<M>>,
        optimizer: &mut ModuleOptimizer,
        sums: GradientsParams,
        backward: impl FnOnce(),
    ) -> PassEnd {
        // The masters on the host move into the pass (no second copy of them while it runs).
        let mut host = host.filter(|slot| slot.is_some());
        let pass = self.take_pass::<M>();
        {
            let mut inner = lock(&pass.table.inner);
            inner.sums = sums;
            let plain = masters.clone().map(&mut Untap { ids: &pass.ids });
            match host.as_mut().and_then(|slot| slot.take()) {
                Some(on_host) => {
                    inner.dtypes = dtypes(&on_host);
                    inner.model = Some(on_host);
                    inner.device_model = Some(plain);
                }
                None => {
                    inner.dtypes = dtypes(masters);
                    inner.model = Some(plain);
                }
            }
            *masters = masters.clone().map(&mut Placeholders { ids: &pass.ids });
            inner.optimizer = Some(std::mem::replace(optimizer, SgdConfig::new().init()));
        }
        backward();
        let mut guard = lock(&pass.table.inner);
        let inner = &mut *guard;
        let stepped = inner.model.take().expect("the masters are back");
        match host.as_mut() {
            Some(slot) => {
                **slot = Some(stepped);
                *masters = inner
                    .device_model
                    .take()
                    .expect("the device's model is back");
            }
            None => *masters = stepped,
        }
        *optimizer = inner.optimizer.take().expect("the optimizer is back");
        // The group's sums of parameters this micro-batch gave no gradient: stepped as the
        // ordinary step steps them.
        let mut left = std::mem::take(&mut inner.sums);
        if inner.settings.log_norm {
            leftover_parts(masters, &left, inner);
        }
        if let Some(factor) = inner.settings.unscale {
            grads::scale(masters, &mut left, factor);
        }
        if let Some(factor) = inner.settings.coefficient {
            grads::scale(masters, &mut left, factor);
        }
        if !left.is_empty() {
            let ids: Vec<ParamId> = crate::train::params::ids_with_grad(masters, &left)
                .into_iter()
                .collect();
            let lr = inner.settings.lr;
            match (host, &inner.settings.offload) {
                (Some(slot), Some(device)) => {
                    let on_host = slot.take().expect("the masters are on the host");
                    let timer = crate::offload::HostTimer::start(true);
                    let on_host = optimizer.step(lr, on_host, left);
                    timer.stop();
                    crate::offload::count_steps(ids.len() as u64);
                    let mut values = crate::offload::values_of(&on_host, Some(&ids));
                    *slot = Some(on_host);
                    *masters = crate::offload::put_up(masters.clone(), &mut values, device, true);
                }
                (_, None) => *masters = optimizer.step(lr, masters.clone(), left),
                // 16-bit weights: each goes down, steps on the host and goes back up.
                (None, Some(device)) => {
                    let mut on_host = masters.clone();
                    for id in &ids {
                        on_host = crate::offload::down_param(on_host, *id);
                    }
                    let timer = crate::offload::HostTimer::start(true);
                    let stepped = optimizer.step(lr, on_host, left);
                    timer.stop();
                    crate::offload::count_steps(ids.len() as u64);
                    let mut values = crate::offload::values_of(&stepped, Some(&ids));
                    *masters = crate::offload::put_up(stepped, &mut values, device, true);
                }
            }
        }
        let norm = if inner.settings.log_norm {
            norm_of(masters, &mut inner.parts, inner.settings.norm_type)
        } else {
            None
        };
        let reached = std::mem::take(&mut inner.reached);
        drop(guard);
        self.pass = Some(Box::new(pass));
        PassEnd { norm, reached }
    }
}

/// The norm's parts of the group's sums whose parameters' taps did not run (no gradient in
/// this micro-batch), unscaled as the taps' are.
fn leftover_parts<M: Module>(masters: &M, sums: &GradientsParams, inner: &mut Inner<M>) {
    struct Left<'a> {
        sums: &'a GradientsParams,
        reached: &'a HashSet<ParamId>,
        parts: &'a mut HashMap<ParamId, Tensor<1>>,
        unscale: Option<f64>,
        norm_type: f64,
    }
    impl ModuleVisitor for Left<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.reached.contains(&param.id) || self.parts.contains_key(&param.id) {
                return;
            }
            let Some(sum) = self.sums.get::<D>(param.id) else {
                return;
            };
            let sum = match self.unscale {
                Some(factor) => sum.mul_scalar(factor),
                None => sum,
            };
            self.parts
                .insert(param.id, grads::norm_part(sum, self.norm_type));
        }
    }
    masters.visit(&mut Left {
        sums,
        reached: &inner.reached,
        parts: &mut inner.parts,
        unscale: inner.settings.unscale,
        norm_type: inner.settings.norm_type,
    });
}

/// Each float parameter's dtype, by id.
fn dtypes<M: Module>(model: &M) -> HashMap<ParamId, DType> {
    struct Dtypes(HashMap<ParamId, DType>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id, param.val().dtype());
        }
    }
    let mut found = Dtypes(HashMap::new());
    model.visit(&mut found);
    found.0
}

/// The norm of the parts, added in `model`'s visiting order (as [`grads::global_norm`] adds
/// them).
fn norm_of<M: Module>(
    model: &M,
    parts: &mut HashMap<ParamId, Tensor<1>>,
    norm_type: f64,
) -> Option<f64> {
    struct Order<'a> {
        parts: &'a HashMap<ParamId, Tensor<1>>,
        norm: NormParts,
    }
    impl ModuleVisitor for Order<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(part) = self.parts.get(&param.id) {
                self.norm.add(part.clone());
            }
        }
    }
    let mut order = Order {
        parts,
        norm: NormParts::new(norm_type),
    };
    model.visit(&mut order);
    let norm = order.norm.finish();
    parts.clear();
    norm
}

/// The parameters `ids` replaced by one-element placeholders of their dtype: while backward
/// runs, the model that held them holds none, so that each old weight is freed as soon as its
/// parameter has stepped.
struct Placeholders<'a> {
    ids: &'a [ParamId],
}

impl ModuleMapper for Placeholders<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        if !self.ids.contains(&id) {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let placeholder = Tensor::<D>::zeros([1; D], &tensor.device()).cast(tensor.dtype());
        Param::from_mapped_value(id, placeholder, mapper)
    }
}
