//! The optimizer adapter: the group's sums kept between micro-batches; at a group's end,
//! unscale, overflow check, global-norm clipping, and the user's optimizer stepped.

use std::sync::{Arc, Mutex};

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;

use super::model::{merge_devices, MemsaveModel};
use super::{lock, Shared, StepReport};
use crate::train::{grads, STEP_GROUP_BYTES};

/// The user's Burn optimizer, stepped at the end of each group of micro-batches (see the
/// [module docs](super)). Its record is the inner optimizer's and memsave's state (the loss
/// scaler, the micro-batches seen) as JSON: Burn's checkpointer saves and restores both.
#[derive(Clone)]
pub struct MemsaveOptimizer<O> {
    inner: O,
    shared: Arc<Mutex<Shared>>,
}

impl<O> MemsaveOptimizer<O> {
    pub(crate) fn new(inner: O, shared: Arc<Mutex<Shared>>) -> Self {
        MemsaveOptimizer { inner, shared }
    }

    /// The user's optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }
}

/// Steps `inner` on `model` a chunk of parameters at a time (as memsave's runner does), calling
/// `prepare` on each chunk's gradients first.
fn step_chunks<B, M, O>(
    inner: &mut O,
    lr: LearningRate,
    mut model: M,
    grads: GradientsParams,
    weights: Option<&mut super::Weights>,
    prepare: &mut dyn FnMut(&M, &mut GradientsParams),
) -> (M, Option<f64>)
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let mut store = weights.map(|weights| store_of::<B, M>(weights, &model));
    for mut chunk in grads::into_chunks::<B, M>(&model, grads, STEP_GROUP_BYTES) {
        prepare(&model, &mut chunk);
        let Some(store) = store.as_deref_mut() else {
            model = inner.step(lr, model, chunk);
            continue;
        };
        // 16-bit weights: the chunk widened to fp32 for the step, rounded back after.
        let (wide, old) = crate::train::weights::model::widen::<B, M>(model, &chunk);
        let stepped = inner.step(lr, wide, chunk);
        model = crate::train::weights::model::narrow::<B, M>(stepped, old, store);
    }
    let unchanged = store
        .and_then(|store| store.end_step())
        .map(|figures| figures.fraction());
    (model, unchanged)
}

/// The run's store of 16-bit weights, made at the first step (with a checkpoint's state).
fn store_of<'a, B: AutodiffBackend, M: AutodiffModule<B>>(
    weights: &'a mut super::Weights,
    model: &M,
) -> &'a mut crate::train::WeightStore<B::InnerBackend> {
    if weights.store.is_none() {
        let mut store = crate::train::WeightStore::<B::InnerBackend>::new(weights.spec);
        store.set_positions(crate::parallel::zero::positions::<B, M>(model));
        if let Some(saved) = weights.saved.take() {
            let device = Default::default();
            if let Err(error) = store.load_bytes(&saved, weights.spec, &device) {
                tracing::warn!(
                    target: "memsave",
                    "the checkpoint's store of 16-bit weights does not load ({error}): the \
                     rounding's state starts afresh"
                );
            }
        }
        weights.store = Some(Box::new(store));
    }
    weights
        .store
        .as_mut()
        .expect("made above")
        .as_any_mut()
        .downcast_mut()
        .expect("the store of the model's backend")
}

impl<B, M, O> Optimizer<MemsaveModel<B, M>, B> for MemsaveOptimizer<O>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    type Record = (O::Record, String);

    fn step(
        &mut self,
        lr: LearningRate,
        module: MemsaveModel<B, M>,
        grads: GradientsParams,
    ) -> MemsaveModel<B, M> {
        let module = self.step_micro_batch(lr, module, grads);
        lock(&self.shared).record();
        module
    }

    fn step_multi(
        &mut self,
        lr: LearningRate,
        module: MemsaveModel<B, M>,
        grads: MultiGradientsParams,
    ) -> MemsaveModel<B, M> {
        let grads = merge_devices::<B, M>(&module.model, grads);
        self.step(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        (self.inner.to_record(), lock(&self.shared).state_json())
    }

    fn load_record(self, record: Self::Record) -> Self {
        let (inner, state) = record;
        {
            let mut shared = lock(&self.shared);
            if let Err(error) = shared.load_state_json(&state) {
                shared.warn(format!(
                    "the optimizer checkpoint's memsave state could not be read ({error}): the \
                     loss scaler and the micro-batch count start afresh"
                ));
            }
        }
        MemsaveOptimizer {
            inner: self.inner.load_record(inner),
            shared: self.shared,
        }
    }
}

impl<O> MemsaveOptimizer<O> {
    /// One micro-batch: its gradients added to the group's sums, or the group's step.
    fn step_micro_batch<B, M>(
        &mut self,
        lr: LearningRate,
        mut module: MemsaveModel<B, M>,
        mut grads: GradientsParams,
    ) -> MemsaveModel<B, M>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let mut shared = lock(&self.shared);
        if shared.failure.is_some() {
            // The training stopped with an error: no step on what is left. Where nothing else
            // would show the error, it is a panic here, on burn-train's loop thread.
            if let Some(message) = shared.unseen_failure() {
                drop(shared);
                panic!("{message}");
            }
            return module;
        }
        let iter = shared.iter;
        shared.iter += 1;
        if iter == 0 && shared.run_length.wanted && !shared.metrics_registered {
            shared.warn(
                "`Memsave::accumulate_auto` learns the run's length from memsave's metrics, and \
                 none is registered: add `.metrics(memsave.metrics())` to the training, or give \
                 the length with `Memsave::accumulate(cumulative_iters, total_iters)`"
                    .to_string(),
            );
        }
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
        shared.last = StepReport {
            iter,
            ..StepReport::default()
        };
        let mixed = shared.mixed.is_some();
        if !shared.ends_group(iter) {
            if mixed {
                // The group's first sums, in fp32.
                grads::to_f32::<B, M>(&module.model, &mut grads);
            }
            shared.summed = Some(grads);
            shared.last.loss_scale = shared.mixed.as_ref().map(|m| m.scaler.loss_scale());
            return module;
        }
        let clip = shared.grad_clip;
        let Some(mixed) = shared.mixed.as_mut() else {
            let norm = grads::norm_and_clip::<B, M>(&module.model, &mut grads, clip.as_ref());
            let model = module.model.clone();
            (module.model, _) =
                step_chunks(&mut self.inner, lr, model, grads, None, &mut |_, _| {});
            shared.last.stepped = true;
            shared.last.grad_norm = norm;
            return module;
        };
        // The sums are fp32 (accumulation) or the copy's half gradients, and scaled: their norm
        // is taken as they are and unscaled after; each chunk is cast, unscaled and clipped just
        // before it steps (no full fp32 copy of half gradients).
        let scale = mixed.scaler.loss_scale();
        let norm_type = clip.as_ref().map_or(2.0, |clip| clip.norm_type);
        let norm =
            grads::global_norm::<B, M>(&module.model, &grads, norm_type).map(|norm| norm / scale);
        if norm.is_some_and(|norm| !norm.is_finite()) {
            let advice = mixed.scaler.first_overflow_advice(true);
            mixed.scaler.update_scale(true);
            let lowered = mixed.scaler.loss_scale();
            if let Some(advice) = advice {
                shared.warn(advice);
            }
            shared.warn(format!(
                "iteration {iter}: gradient overflow (inf or NaN) at loss scale {scale}; the step \
                 is skipped and the loss scale lowered to {lowered}"
            ));
            shared.last.overflow = true;
            shared.last.loss_scale = Some(lowered);
            shared.skipped_steps += 1;
            return module;
        }
        let coefficient = match (&clip, norm) {
            (Some(clip), Some(norm)) => Some(clip.max_norm / (norm + 1e-6)),
            _ => None,
        }
        .filter(|&coefficient| coefficient < 1.0);
        mixed.scaler.update_scale(false);
        let loss_scale = mixed.scaler.loss_scale();
        let model = module.model.clone();
        let weights = shared.weights.as_mut();
        let unchanged;
        (module.model, unchanged) = step_chunks(
            &mut self.inner,
            lr,
            model,
            grads,
            weights,
            &mut |model, chunk| {
                grads::to_f32::<B, M>(model, chunk);
                grads::scale::<B, M>(model, chunk, 1.0 / scale);
                if let Some(coefficient) = coefficient {
                    grads::scale::<B, M>(model, chunk, coefficient);
                }
            },
        );
        shared.last.weights_unchanged = unchanged;
        shared.last.stepped = true;
        shared.last.grad_norm = norm;
        shared.last.loss_scale = Some(loss_scale);
        drop(shared);
        module.refresh_half();
        module
    }
}
