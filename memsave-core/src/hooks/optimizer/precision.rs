//! The precision part: fp32, or half precision with a loss scaler and fp32 master weights (the
//! forward runs on a half copy of them, made again after each step).

use crate::fp16::PrecisionExt;
use std::path::Path;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use super::Groups;
use crate::fp16::{wrap_fp16_model, Precision};
use crate::memory;
use crate::scaler::LossScaler;
use crate::train::{TrainModel, TrainState};
use crate::{Error, Result};

/// The precision part under mixed precision: the scaler, and the half type of the forward copy.
#[derive(Clone, Debug)]
pub(super) struct Mixed {
    pub(super) scaler: LossScaler,
    pub(super) precision: Precision,
    /// The forward runs on the weights themselves (16-bit weights of the forward's type): no
    /// copy is made.
    pub(super) on_weights: bool,
    /// Not asked for: 16-bit weights without `[fp16]` run their forward in their own type
    /// (the hook keeps its fp32 name).
    pub(super) implied: bool,
}

impl Mixed {
    /// Mixed precision as asked for, with `scaler`, the forward in `precision`.
    pub(super) fn new(scaler: LossScaler, precision: Precision) -> Self {
        Mixed {
            scaler,
            precision,
            on_weights: false,
            implied: false,
        }
    }

    /// The forward of 16-bit weights of `precision` without `[fp16]`: on the weights, bf16
    /// without loss scaling (a static scale of 1), f16 with MMCV's dynamic scaler.
    fn implied(precision: Precision) -> Self {
        let scaler = match precision {
            Precision::Bf16 => LossScaler::new(1.0, crate::scaler::ScaleMode::Static, 2.0, 1000)
                .expect("a valid static scale"),
            // PyTorch's `GradScaler` starts at 2^16 (MMCV's 2^32 would skip the first steps).
            Precision::F16 => {
                LossScaler::new(65536.0, crate::scaler::ScaleMode::Dynamic, 2.0, 1000)
                    .expect("a valid dynamic scale")
            }
        };
        Mixed {
            scaler,
            precision,
            on_weights: true,
            implied: true,
        }
    }

    /// The half copy the forward runs on, made afresh from the fp32 weights: the old copy goes
    /// before the new one is made.
    pub(super) fn refresh_forward<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &mut TrainState<B, M>,
    ) {
        if self.on_weights {
            return;
        }
        state.forward_model = None;
        state.forward_model = Some(self.forward_copy(state));
    }

    /// The half copy the forward runs on, made from the weights (fp32, or 16-bit weights of
    /// the other half type).
    fn forward_copy<B: AutodiffBackend, M: TrainModel<B>>(&self, state: &TrainState<B, M>) -> M {
        memory::scope(memory::phase::HALF_WEIGHTS, || {
            let copy = wrap_fp16_model(state.model.clone(), self.precision);
            let other = self.precision.other().dtype();
            crate::fp16::recast_params(copy, other, self.precision.dtype())
        })
    }

    /// A step skipped because a gradient overflowed (inf or NaN) on some peer: the scale backs
    /// off, with MMCV's warning (and, at the run's first step, advice on the initial scale).
    pub(super) fn skip_overflow<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) {
        let scale = self.scaler.loss_scale();
        if let Some(advice) = self.scaler.first_overflow_advice(true) {
            state.warn(advice);
        }
        self.scaler.update_scale(true);
        state.log.overflow = true;
        state.warn(format!(
            "iteration {}: gradient overflow (inf or NaN) at loss scale {scale}; the step is \
             skipped and the loss scale lowered to {}",
            state.iter,
            self.scaler.loss_scale()
        ));
        state.log.loss_scale = Some(self.scaler.loss_scale());
    }

    /// After a step: the scale grows on MMCV's schedule, and the log shows it.
    pub(super) fn stepped<B: AutodiffBackend, M: TrainModel<B>>(
        &mut self,
        state: &mut TrainState<B, M>,
    ) {
        self.scaler.update_scale(false);
        state.log.loss_scale = self.logged_scale();
    }

    /// The scale the log shows: none for bf16 weights without `[fp16]` (a constant 1).
    pub(super) fn logged_scale(&self) -> Option<f64> {
        let constant = self.implied && self.precision == Precision::Bf16;
        (!constant).then(|| self.scaler.loss_scale())
    }
}

/// The loss backward starts from: divided by MMCV's loss factor, and scaled (in fp32) under
/// mixed precision.
pub(super) fn loss_to_backward<B: AutodiffBackend, M: TrainModel<B>>(
    mixed: Option<&Mixed>,
    groups: Groups,
    state: &TrainState<B, M>,
    loss: Tensor<B, 1>,
) -> Tensor<B, 1> {
    let divisor = groups.loss_factor(state.iter, state.max_iters) as f64;
    match mixed {
        None => loss.div_scalar(divisor),
        Some(mixed) => loss
            .cast(DType::F32)
            .mul_scalar(mixed.scaler.loss_scale() / divisor),
    }
}

/// Before the run, under mixed precision or with 16-bit weights: the model must be fp32 (the
/// masters, or the weights to compress). 16-bit weights are cast to their type once, here (the
/// model's `fp16_enabled` flag on, its normalisation layers kept fp32, as `wrap_fp16_model`
/// does), and the forward runs on them: without `[fp16]` in their own type, with `[fp16]` of
/// their type on them too, and with `[fp16]` of the other type on a copy in that type. Under
/// mixed precision with fp32 weights, the half copy the forward runs on is made.
pub(super) fn before_run<B: AutodiffBackend, M: TrainModel<B>>(
    mixed: &mut Option<Mixed>,
    state: &mut TrainState<B, M>,
) -> Result<()> {
    let weights = state.weights.as_ref().map(|store| store.spec());
    let frozen = state
        .optimizer_spec
        .as_ref()
        .and_then(|spec| spec.weights.frozen);
    if mixed.is_none() && weights.is_none() {
        return compress_frozen(frozen, state);
    }
    if let Some(half) = crate::train::params::first_half_param::<B, M>(&state.model) {
        let keeper = if weights.is_some() {
            "with `optimizer.weight_dtype` set the runner casts the weights to their 16-bit \
             type itself"
        } else {
            "under mixed precision the optimizer hook keeps the weights in fp32 as the masters \
             and makes the half copy for the forward itself"
        };
        return Err(Error::invalid(
            "model",
            format!(
                "the runner was given a model already in half precision (`{half}` is half): \
                 {keeper}. Pass the fp32 model, without `wrap_fp16_model`"
            ),
        ));
    }
    if let Some(spec) = weights {
        let precision = spec
            .dtype
            .precision()
            .expect("a store holds 16-bit weights");
        if !B::supports_dtype(&state.device, precision.dtype()) {
            let other = precision.other();
            let instead = if B::supports_dtype(&state.device, other.dtype()) {
                format!("it has {other}: set `optimizer.weight_dtype = \"{other}\"`")
            } else {
                "it has neither half type: leave the weights in fp32".to_string()
            };
            return Err(Error::invalid(
                "optimizer.weight_dtype",
                format!(
                    "the device {:?} has no {precision} arithmetic for the weights to be kept \
                     in; {instead}",
                    state.device
                ),
            ));
        }
        let positions = crate::parallel::zero::positions::<B, M>(&state.model);
        if let Some(store) = state.weights.as_mut() {
            store.set_positions(positions);
        }
        state.model = wrap_fp16_model(state.model.clone(), precision);
        let mixed = mixed.get_or_insert_with(|| Mixed::implied(precision));
        mixed.on_weights = mixed.precision == precision;
    }
    compress_frozen(frozen, state)?;
    let Some(mixed) = mixed.as_ref().filter(|mixed| !mixed.on_weights) else {
        return Ok(());
    };
    state.forward_model = Some(mixed.forward_copy(state));
    Ok(())
}

/// The frozen weights into the run's table as `frozen` says (none where it says nothing),
/// with a notice of what they hold.
fn compress_frozen<B: AutodiffBackend, M: TrainModel<B>>(
    frozen: Option<crate::nn::FrozenDtype>,
    state: &mut TrainState<B, M>,
) -> Result<()> {
    let Some(frozen) = frozen else {
        return Ok(());
    };
    let (model, count, bytes) = crate::nn::frozen::compress_frozen(state.model.clone(), frozen);
    state.model = model;
    if count == 0 {
        state.warn(format!(
            "`optimizer.frozen_dtype = \"{frozen}\"`: the model has no frozen weight (no \
             parameter of rank 2 or more without `require_grad`): nothing is compressed"
        ));
    } else {
        tracing::info!(
            target: "memsave",
            "{count} frozen weights held in {frozen}: {:.1} MiB",
            bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}

/// After the first forward: a frozen weight held compressed that no memsave layer read was
/// read by a layer that does not dequantize it (it saw the placeholder): an error naming them,
/// before anything trains.
pub(super) fn check_frozen_reads<B: AutodiffBackend, M: TrainModel<B>>(
    state: &TrainState<B, M>,
) -> Result<()> {
    let frozen = crate::nn::frozen::frozen_weights();
    if frozen.is_empty() {
        return Ok(());
    }
    let ids = crate::train::params::param_paths::<B, M>(&state.model)
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    let unread = frozen.unread(&ids);
    if unread.is_empty() {
        return Ok(());
    }
    Err(Error::invalid(
        "optimizer.frozen_dtype",
        format!(
            "these frozen weights are read by layers that do not dequantize them per layer \
             (Burn's own `forward`; memsave's `nn::conv2d`, `nn::linear` and BatchNorm's fused \
             convolutions do): {}. Call memsave's layers for them, or leave `frozen_dtype` out",
            unread.join(", ")
        ),
    ))
}

/// A snapshot of another precision loads (its weights are fp32), with a warning that says what
/// becomes of the loss scaler.
pub(super) fn after_load<B: AutodiffBackend, M: TrainModel<B>>(
    now: &str,
    saved: Option<&String>,
    state: &mut TrainState<B, M>,
    path: &Path,
) {
    let Some(saved) = saved.filter(|saved| *saved != now) else {
        return;
    };
    let scaler = if now == "fp32" {
        "its loss scaler is dropped"
    } else if saved == "fp32" {
        "the loss scaler starts afresh at its `init_scale`"
    } else {
        "the loss scaler carries on"
    };
    state.warn(format!(
        "checkpoint {} was trained in {saved}, and this config trains in {now}: the weights load \
         (they are kept in fp32), {scaler}; set `[fp16]` as the run that wrote it did to resume \
         it exactly",
        path.display()
    ));
}
