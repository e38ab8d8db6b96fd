//! The `TrainStep` wrapper: the forward of the user's model, and the backward of the scaled,
//! divided loss into the group's gradient sums.

use crate::fp16::PrecisionExt;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, Devices, Module, ModuleMapper, ModuleVisitor};
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor};
use burn::train::{
    ClassificationOutput, ItemLazy, MultiLabelClassificationOutput, RegressionOutput,
    SequenceOutput, TrainOutput, TrainStep,
};

use super::metrics::LazyLoss;
use super::{lock, Shared};
use crate::fp16::{wrap_fp16_model, Fp16Module, Precision};
use crate::train::grads;
use crate::{Error, Result};

/// The forward of a training step: what a burn-train model's `TrainStep::step` computes before
/// `loss.backward()`. Implement it instead of `TrainStep`; [`MemsaveModel`] is the `TrainStep`.
///
/// ```ignore
/// impl<B: AutodiffBackend> ForwardStep for Model<B> {
///     type Input = MnistBatch<B>;
///     type Output = ClassificationOutput<B>;
///     fn forward_step(&self, batch: MnistBatch<B>) -> ClassificationOutput<B> {
///         self.forward_classification(batch.images, batch.targets)
///     }
/// }
/// ```
pub trait ForwardStep {
    /// The batch.
    type Input: Send + 'static;
    /// What the metrics read; it holds the loss ([`LossOutput`]).
    type Output: ItemLazy + 'static;

    /// The forward pass on `input`.
    fn forward_step(&self, input: Self::Input) -> Self::Output;
}

/// An output that holds the loss to back-propagate (burn-train's outputs all do).
pub trait LossOutput<B: Backend> {
    /// The loss, a one-element tensor.
    fn loss(&self) -> Tensor<B, 1>;
}

macro_rules! loss_field {
    ($($output:ident),*) => {$(
        impl<B: Backend> LossOutput<B> for $output<B> {
            fn loss(&self) -> Tensor<B, 1> {
                self.loss.clone()
            }
        }
    )*};
}
loss_field!(
    ClassificationOutput,
    MultiLabelClassificationOutput,
    RegressionOutput,
    SequenceOutput
);

/// The user's model as burn-train's `TrainStep` (see the [module docs](super)): the fp32
/// weights (the masters), and under mixed precision their half copy, which the forward runs on
/// and which the optimizer refreshes after each step. Its record is the model's own: Burn's
/// checkpoints of it load into the plain model and back.
pub struct MemsaveModel<B: AutodiffBackend, M> {
    pub(crate) model: M,
    pub(crate) half: Option<M>,
    /// Makes the half copy (set where `M: Fp16Module` is known).
    pub(crate) refresh: fn(M, Precision) -> M,
    pub(crate) shared: Arc<Mutex<Shared>>,
    _backend: PhantomData<fn() -> B>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> MemsaveModel<B, M> {
    pub(crate) fn new(model: M, shared: Arc<Mutex<Shared>>) -> Result<Self>
    where
        M: Fp16Module,
    {
        let (precision, weights) = {
            let shared = lock(&shared);
            let weights = shared.weights.as_ref().map(|weights| weights.spec.dtype);
            (shared.mixed.as_ref().map(|mixed| mixed.precision), weights)
        };
        if precision.is_some() {
            if let Some(half) = crate::train::params::first_half_param::<B, M>(&model) {
                return Err(Error::invalid(
                    "model",
                    format!(
                        "the model is already in half precision (`{half}` is half): under \
                         mixed precision memsave keeps the weights in fp32 as the masters and \
                         makes the half copy for the forward itself. Pass the fp32 model, \
                         without `wrap_fp16_model`"
                    ),
                ));
            }
        }
        // 16-bit weights: the model in their type, the forward on it.
        let model = match weights.and_then(|dtype| dtype.precision()) {
            Some(precision) => wrap_fp16_model(model, precision),
            None => model,
        };
        let mut wrapped = MemsaveModel {
            model,
            half: None,
            refresh: |model, precision| wrap_fp16_model(model, precision),
            shared,
            _backend: PhantomData,
        };
        wrapped.refresh_half();
        Ok(wrapped)
    }

    /// The fp32 weights.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The fp32 weights, unwrapped.
    pub fn into_model(self) -> M {
        self.model
    }

    /// Makes the half copy again from the masters (under mixed precision).
    pub(crate) fn refresh_half(&mut self) {
        let (precision, weights) = {
            let shared = lock(&self.shared);
            let weights = shared
                .weights
                .as_ref()
                .and_then(|w| w.spec.dtype.precision());
            (shared.mixed.as_ref().map(|mixed| mixed.precision), weights)
        };
        // The old copy goes before the new one is made.
        self.half = None;
        // 16-bit weights of the forward's type are the forward's weights: no copy.
        if let Some(precision) = precision.filter(|&precision| Some(precision) != weights) {
            let copy = (self.refresh)(self.model.clone(), precision);
            self.half = Some(crate::fp16::recast_params(
                copy,
                precision.other().dtype(),
                precision.dtype(),
            ));
        }
    }

    fn with(self, model: M, half: Option<M>) -> Self {
        MemsaveModel {
            model,
            half,
            ..self
        }
    }
}

impl<B, M> TrainStep for MemsaveModel<B, M>
where
    B: AutodiffBackend,
    M: ForwardStep + AutodiffModule<B> + Fp16Module,
    M::Output: LossOutput<B>,
{
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, input: Self::Input) -> TrainOutput<Self::Output> {
        // In the run's context (Burn calls this on its training thread): a thread that holds
        // another run cannot train this one.
        let context = lock(&self.shared).context();
        match context.enter() {
            Ok(_entered) => self.step_here(input),
            Err(error) => {
                // burn-train needs this step's output: it runs, the training stops after it.
                lock(&self.shared).fail(error);
                self.step_here(input)
            }
        }
    }
}

impl<B, M> MemsaveModel<B, M>
where
    B: AutodiffBackend,
    M: ForwardStep + AutodiffModule<B> + Fp16Module,
    M::Output: LossOutput<B>,
{
    /// [`TrainStep::step`] in the run's context. A failure (a segment's, or a module switched
    /// on without a `#[with_cp]` method) stops the training ([`super::Shared::fail`]) and the
    /// step gives no gradients.
    fn step_here(&self, input: M::Input) -> TrainOutput<M::Output> {
        let (divisor, scale, summed, first) = {
            let mut shared = lock(&self.shared);
            let iter = shared.forwards;
            shared.forwards += 1;
            let divisor = shared.loss_factor(iter) as f64;
            let scale = shared.mixed.as_ref().map(|mixed| mixed.scaler.loss_scale());
            let first = !std::mem::replace(&mut shared.checked_segments, true);
            (divisor, scale, shared.summed.take(), first)
        };
        let forward = self.half.as_ref().unwrap_or(&self.model);
        let (item, grads) = match scale {
            // fp32: the group's sums start the backward pass (no second set is made).
            None => {
                let item = self.model.forward_step(input);
                let loss = item.loss().div_scalar(divisor);
                let grads = grads::backward::<B, M>(loss, &self.model, summed);
                (item, grads)
            }
            // Half (the copy, or 16-bit weights): the gradients are half and scaled; each is
            // cast as it is added to its fp32 sum.
            Some(scale) => {
                let item = forward.forward_step(input);
                let loss = item.loss().cast(DType::F32).mul_scalar(scale / divisor);
                let grads =
                    grads::backward::<B, M>(loss, forward, None).map(|grads| match summed {
                        Some(mut summed) => {
                            grads::accumulate::<B, M>(&self.model, &mut summed, grads);
                            summed
                        }
                        None => grads,
                    });
                (item, grads)
            }
        };
        // The first step: a module switched on without a `#[with_cp]` method trained plainly.
        let checked = if first {
            crate::check::segments_ran(&self.model)
        } else {
            Ok(None)
        };
        if let Ok(Some(warning)) = &checked {
            lock(&self.shared).warnings.push(warning.clone());
        }
        let grads = match grads.and_then(|grads| checked.map(|_| grads)) {
            Ok(grads) => grads,
            Err(error) => {
                lock(&self.shared).fail(error);
                GradientsParams::new()
            }
        };
        // The loss for memsave's metrics, read only if one asks (reading waits for the device).
        let loss = item.loss().inner();
        lock(&self.shared).pending_loss = Some(LazyLoss(Arc::new(move || {
            loss.clone().into_scalar().elem::<f64>()
        })));
        TrainOutput { grads, item }
    }
}

impl<B: AutodiffBackend, M: Clone> Clone for MemsaveModel<B, M> {
    fn clone(&self) -> Self {
        MemsaveModel {
            model: self.model.clone(),
            half: self.half.clone(),
            refresh: self.refresh,
            shared: self.shared.clone(),
            _backend: PhantomData,
        }
    }
}

impl<B: AutodiffBackend, M: fmt::Debug> fmt::Debug for MemsaveModel<B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemsaveModel")
            .field("model", &self.model)
            .field("half_copy", &self.half.is_some())
            .finish()
    }
}

impl<B: AutodiffBackend, M: fmt::Display> fmt::Display for MemsaveModel<B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.model.fmt(f)
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Module<B> for MemsaveModel<B, M> {
    type Record = M::Record;

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        self.model.collect_devices(devices)
    }

    fn fork(self, device: &B::Device) -> Self {
        let model = self.model.clone().fork(device);
        let half = self.half.clone().map(|half| half.fork(device));
        self.with(model, half)
    }

    fn to_device(self, device: &B::Device) -> Self {
        let model = self.model.clone().to_device(device);
        let half = self.half.clone().map(|half| half.to_device(device));
        self.with(model, half)
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        self.model.visit(visitor)
    }

    fn map<Mapper: ModuleMapper<B>>(self, mapper: &mut Mapper) -> Self {
        let model = self.model.clone().map(mapper);
        let mut wrapped = self.with(model, None);
        wrapped.refresh_half();
        wrapped
    }

    fn load_record(self, record: Self::Record) -> Self {
        let model = self.model.clone().load_record(record);
        let mut wrapped = self.with(model, None);
        wrapped.refresh_half();
        wrapped
    }

    fn into_record(self) -> Self::Record {
        self.model.into_record()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> AutodiffModule<B> for MemsaveModel<B, M> {
    type InnerModule = M::InnerModule;

    /// The fp32 model without autodiff: validation runs the user's own `InferenceStep`.
    fn valid(&self) -> Self::InnerModule {
        self.model.valid()
    }

    /// The model with no strategy on (fp32, a step every micro-batch): the strategies live in
    /// [`super::Memsave`], which an inner module does not carry.
    fn from_inner(module: Self::InnerModule) -> Self {
        MemsaveModel {
            model: M::from_inner(module),
            half: None,
            refresh: |model, _| model,
            shared: Arc::default(),
            _backend: PhantomData,
        }
    }
}

/// A gradient set with only the gradients of `model`'s parameters that `grads` holds, summed
/// over the devices (Burn's `step_multi`).
pub(crate) fn merge_devices<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mut grads: burn::optim::MultiGradientsParams,
) -> GradientsParams {
    struct Merge<'a, B: AutodiffBackend> {
        from: &'a mut burn::optim::MultiGradientsParams,
        into: GradientsParams,
        _backend: PhantomData<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Merge<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            if let Some((grad, _)) = self.from.remove::<B::InnerBackend, D>(param.id) {
                self.into.register::<B::InnerBackend, D>(param.id, grad);
            }
        }
    }
    let mut merge = Merge::<B> {
        from: &mut grads,
        into: GradientsParams::new(),
        _backend: PhantomData,
    };
    model.visit(&mut merge);
    merge.into
}
