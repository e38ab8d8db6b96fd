//! The `TrainStep` wrapper: the forward of the user's model and the backward of the scaled,
//! divided loss (`step`); the group's sums, and at its end the unscale, the overflow check,
//! clipping and the user's optimizer (`optimize`).

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer, MultiGradientsParams};
use burn::tensor::{DType, Device, Tensor};
use burn::train::{
    ClassificationOutput, InferenceStep, ItemLazy, MultiLabelClassificationOutput,
    RegressionOutput, SequenceOutput, TrainOutput, TrainStep,
};

use super::{lock, Shared};
use crate::fp16::{wrap_fp16_model, Fp16Module};
use crate::memory::{in_phase, phase};
use crate::train::params::first_half_param;
use crate::train::step::end_group;
use crate::{grads, Error, Result};

/// The forward of a training step: what a burn-train model's `TrainStep::step` computes before
/// `loss.backward()`. Implement it instead of `TrainStep`; [`MemsaveModel`] is the `TrainStep`.
///
/// ```ignore
/// impl ForwardStep for Model {
///     type Input = MnistBatch;
///     type Output = ClassificationOutput;
///     fn forward_step(&self, batch: MnistBatch) -> ClassificationOutput {
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
pub trait LossOutput {
    /// The loss, a one-element tensor.
    fn loss(&self) -> Tensor<1>;
}

macro_rules! loss_field {
    ($($output:ident),*) => {$(
        impl LossOutput for $output {
            fn loss(&self) -> Tensor<1> {
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
/// and which is made again after each step. Its visit and map are the model's own, so Burn's
/// records of it (burn-train's checkpoints) load into the plain model and back.
pub struct MemsaveModel<M> {
    pub(crate) model: M,
    pub(crate) half: Option<M>,
    pub(crate) shared: Arc<Mutex<Shared>>,
}

impl<M: Module + Fp16Module> MemsaveModel<M> {
    pub(crate) fn new(model: M, shared: Arc<Mutex<Shared>>) -> Result<Self> {
        let (mixed, weights16) = {
            let shared = lock(&shared);
            let weights16 = shared
                .mixed
                .as_ref()
                .filter(|mixed| mixed.weights16)
                .map(|mixed| mixed.precision);
            (shared.mixed.is_some(), weights16)
        };
        // 16-bit weights: the model in their type, the forward on it.
        let model = match weights16 {
            Some(precision) => wrap_fp16_model(model, precision),
            None => model,
        };
        if mixed && weights16.is_none() {
            if let Some(half) = first_half_param(&model) {
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
        let mut wrapped = MemsaveModel {
            model,
            half: None,
            shared,
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
    fn refresh_half(&mut self) {
        // 16-bit weights are the forward's own: no copy.
        let precision = lock(&self.shared)
            .mixed
            .as_ref()
            .filter(|mixed| !mixed.weights16)
            .map(|mixed| mixed.precision);
        // The old copy goes before the new one is made.
        self.half = None;
        if let Some(precision) = precision {
            self.half = Some(wrap_fp16_model(self.model.clone(), precision));
        }
    }

    /// `f` applied to the masters, the half copy made again from them.
    fn remade(self, f: impl FnOnce(M) -> M) -> Self {
        let MemsaveModel { model, shared, .. } = self;
        let mut wrapped = MemsaveModel {
            model: f(model),
            half: None,
            shared,
        };
        wrapped.refresh_half();
        wrapped
    }
}

impl<M> MemsaveModel<M>
where
    M: ForwardStep + Module + Fp16Module + 'static,
    M::Output: LossOutput,
{
    /// The forward on the half copy (or the fp32 weights) and the backward of the loss divided
    /// by the group's size, times the loss scale. A failure (a module switched on without a
    /// `#[with_cp]` method) stops the training and the step gives no gradients.
    fn step_here(&self, input: M::Input) -> TrainOutput<M::Output> {
        let (divisor, scale, first, unused) = {
            let mut shared = lock(&self.shared);
            if let Some(error) = shared.failure.take() {
                // burn-train checks its interrupter after every step: a step after a failure
                // means the one memsave stopped is not the training's.
                drop(shared);
                panic!(
                    "{}",
                    super::failure::stopped(&error.to_string(), super::failure::Unseen::Ignored)
                );
            }
            let iter = shared.forwards;
            shared.forwards += 1;
            let divisor = shared.loss_factor(iter) as f64;
            let scale = shared.mixed.as_ref().map(|mixed| mixed.scaler.loss_scale());
            let first = !std::mem::replace(&mut shared.checked_segments, true);
            (divisor, scale, first, shared.unused_with_cp)
        };
        let forward = self.half.as_ref().unwrap_or(&self.model);
        if let Err(error) = self.begin_dynamic(forward) {
            // The step runs (burn-train needs its output); the training stops after it.
            lock(&self.shared).fail(error);
        }
        // The phases mark the ends of forward and backward for `"dynamic"`'s recording.
        let (item, loss) = in_phase(phase::FORWARD, || {
            let item = forward.forward_step(input);
            // The loss in fp32 (a half loss's own gradient, the scale, would overflow f16).
            let loss = match scale {
                None => item.loss().div_scalar(divisor),
                // MMCV's order: the loss divided by its factor, then scaled.
                Some(scale) => item
                    .loss()
                    .cast(DType::F32)
                    .div_scalar(divisor)
                    .mul_scalar(scale),
            };
            (item, loss)
        });
        // The random stream left as without checkpointing (`checkpoint::backward`).
        let grads = in_phase(phase::BACKWARD, || {
            GradientsParams::from_grads(crate::checkpoint::backward(loss), forward)
        });
        // The loss for memsave's metrics, read only if one asks (reading waits for the device).
        lock(&self.shared).pending_loss = Some(super::metrics::LazyLoss::new(item.loss()));
        if first {
            match crate::check::segments_ran(&self.model, unused) {
                Ok(None) => {}
                Ok(Some(warning)) => lock(&self.shared).warn(warning),
                Err(error) => {
                    lock(&self.shared).fail(error);
                    return TrainOutput {
                        grads: GradientsParams::new(),
                        item,
                    };
                }
            }
        }
        TrainOutput { grads, item }
    }
}

impl<M> TrainStep for MemsaveModel<M>
where
    M: ForwardStep + Module + Fp16Module + 'static,
    M::Output: LossOutput,
{
    type Input = M::Input;
    type Output = M::Output;

    /// `step_here` in the run's context (burn-train calls this on its training
    /// thread): a thread that holds another run cannot train this one, and the training stops
    /// with that error after this step.
    fn step(&self, input: Self::Input) -> TrainOutput<Self::Output> {
        let context = lock(&self.shared)
            .context
            .get_or_insert_with(memsave_common::run::current)
            .clone();
        match context.enter() {
            Ok(_entered) => self.step_here(input),
            Err(error) => {
                // burn-train needs this step's output: it runs, the training stops after it.
                lock(&self.shared).fail(error);
                self.step_here(input)
            }
        }
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let before = lock(&self.shared).iter;
        let model = self.optimize_micro_batch(optim, lr, grads);
        model.end_dynamic();
        let mut shared = lock(&model.shared);
        if shared.iter > before {
            shared.record();
        }
        drop(shared);
        model
    }

    fn optimize_multi(
        self,
        _optim: &mut ModuleOptimizer,
        _lr: ModuleLearningRate,
        _grads: MultiGradientsParams,
    ) -> Self {
        let mut shared = lock(&self.shared);
        shared.fail(Error::invalid(
            "training strategy",
            "memsave's burn-train adapter on Burn 0.22 runs on burn-train's single-device \
             strategy (several devices come with the port's data parallelism): train on one \
             device",
        ));
        if let Some(message) = shared.unseen_failure() {
            drop(shared);
            panic!("{message}");
        }
        drop(shared);
        self
    }
}

impl<M> MemsaveModel<M>
where
    M: ForwardStep + Module + Fp16Module + 'static,
    M::Output: LossOutput,
{
    /// One micro-batch: its gradients added to the group's sums, or the group's step.
    fn optimize_micro_batch(
        mut self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let state = self.shared.clone();
        let mut shared = lock(&state);
        // The rates of every parameter group, as the user's scheduler gave them (the Learner
        // passes the base group's alone: memsave's scheduler gives it one rate).
        let lr = shared.lr.clone().unwrap_or(lr);
        if shared.failure.is_some() {
            // The training stopped with an error: no step on what is left. Where nothing else
            // would show the error, it is a panic here, on burn-train's loop thread.
            if let Some(message) = shared.unseen_failure() {
                drop(shared);
                panic!("{message}");
            }
            return self;
        }
        let iter = shared.iter;
        shared.iter += 1;
        if shared.forwards != shared.iter && !shared.warned_burn_accumulation {
            shared.warned_burn_accumulation = true;
            let forwards = shared.forwards;
            shared.warn(format!(
                "the optimizer was called once for {forwards} forward passes so far, not once \
                 per micro-batch: burn-train's own `grads_accumulation` is on as well as \
                 memsave's, and sums gradients memsave has already grouped; remove \
                 `.grads_accumulation(..)` and keep `Memsave::accumulate` alone"
            ));
            shared.forwards = shared.iter;
        }
        shared.last = super::StepReport {
            iter,
            skipped_steps: shared.skipped_steps,
            ..Default::default()
        };
        // The group's sums, in the masters' dtype (fp32 under mixed precision), still scaled.
        // 16-bit weights: the sums fp32 all the same (the optimizer widens each weight to step
        // it); otherwise the masters' dtype.
        let mut sums = shared.summed.take().unwrap_or_default();
        let weights16 = shared.mixed.as_ref().is_some_and(|mixed| mixed.weights16);
        if weights16 {
            // The step's rounding counted (its share logged below).
            crate::weights16::count_step_rounding(true);
        }
        grads::accumulate(
            &self.model,
            &mut sums,
            grads,
            weights16.then_some(DType::F32),
        );
        if !shared.ends_group(iter) {
            shared.summed = Some(sums);
            shared.last.loss_scale = shared.mixed.as_ref().map(|m| m.scaler.loss_scale());
            return self;
        }
        let clip = shared.grad_clip;
        let refresh = {
            let shared = &mut *shared;
            let scaler = shared.mixed.as_mut().map(|mixed| &mut mixed.scaler);
            let (model, end) = end_group(self.model, sums, clip.as_ref(), scaler, optim, lr, iter);
            self.model = model;
            for warning in end.warnings {
                shared.warn(warning);
            }
            if end.overflow {
                shared.skipped_steps += 1;
            }
            shared.last.overflow = end.overflow;
            shared.last.stepped = end.stepped;
            shared.last.grad_norm = end.grad_norm.filter(|_| end.stepped);
            shared.last.loss_scale = end.loss_scale;
            shared.last.skipped_steps = shared.skipped_steps;
            let weights16 = shared
                .mixed
                .as_ref()
                .filter(|mixed| mixed.weights16 && end.stepped)
                .map(|mixed| mixed.precision);
            if let Some(precision) = weights16 {
                let counted = &mut shared.rounding_counted;
                if let Some((share, warning)) = crate::weights16::step_figures(precision, counted) {
                    shared.last.weights_unchanged = Some(share);
                    if let Some(warning) = warning {
                        shared.warn(warning);
                    }
                }
            }
            end.stepped && shared.mixed.is_some()
        };
        // The half copy is made again without the shared state held (it reads it).
        drop(shared);
        if refresh {
            self.refresh_half();
        }
        self
    }
}

impl<M: InferenceStep> InferenceStep for MemsaveModel<M> {
    type Input = M::Input;
    type Output = M::Output;

    /// The user's own validation step, on the fp32 weights, in the run's context where this
    /// thread can enter it (validation has no error to give: where another run is installed here
    /// it runs in that one).
    fn step(&self, input: Self::Input) -> Self::Output {
        let context = lock(&self.shared)
            .context
            .get_or_insert_with(memsave_common::run::current)
            .clone();
        let _entered = context.enter().ok();
        self.model.step(input)
    }
}

impl<M: Clone> Clone for MemsaveModel<M> {
    fn clone(&self) -> Self {
        MemsaveModel {
            model: self.model.clone(),
            half: self.half.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<M: fmt::Debug> fmt::Debug for MemsaveModel<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemsaveModel")
            .field("model", &self.model)
            .field("half_copy", &self.half.is_some())
            .finish()
    }
}

impl<M: fmt::Display> fmt::Display for MemsaveModel<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.model.fmt(f)
    }
}

impl<M: Module + Fp16Module> Module for MemsaveModel<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.model.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.remade(|model| model.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.remade(|model| model.to_device(device))
    }

    fn train(self) -> Self {
        self.remade(|model| model.train())
    }

    /// The fp32 model for validation (no half copy).
    fn valid(&self) -> Self {
        MemsaveModel {
            model: self.model.valid(),
            half: None,
            shared: self.shared.clone(),
        }
    }

    fn materialize(self) -> Self {
        self.remade(|model| model.materialize())
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.model.visit(visitor)
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        self.remade(|model| model.map(mapper))
    }
}
