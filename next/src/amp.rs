//! Mixed precision in a user's own training loop on Burn 0.22: MMCV's `Fp16OptimizerHook` as
//! three calls a step. The model the user keeps is fp32 (the master weights); each step's
//! forward runs on a half copy of it, the loss is scaled before backward (so that small
//! gradients do not underflow in half precision), and the step unscales the gradients onto the
//! masters in fp32, skips the step when a gradient overflowed (inf or NaN), clips by the global
//! norm, steps the user's optimizer and updates the scale.
//!
//! The half copy takes half inputs: a `#[memsave::model]` whose forward is `#[auto_fp16]` casts
//! them itself; a bare Burn layer, as here, is given them cast (`Precision::dtype`). The loss is
//! computed in fp32 (MMCV's `#[force_fp32]` on the loss, `out_fp32` on the forward, or a cast):
//! an f16 loss's own gradient is the loss scale, which f16 cannot hold past 65504.
//!
//! ```
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::SgdConfig;
//! use burn::prelude::*;
//! use burn::tensor::DType;
//! use memsave_next::amp::MixedPrecision;
//! use memsave_next::fp16::{Precision, PrecisionExt};
//!
//! let device = Device::flex().autodiff();
//! let mut model: Linear = LinearConfig::new(4, 2).init(&device);
//! let mut optimizer = SgdConfig::new().init();
//! let mut amp = MixedPrecision::for_precision(Precision::F16);
//! for _ in 0..3 {
//!     let half = amp.half_model(&model);
//!     let x = Tensor::<2>::ones([8, 4], &device).cast(amp.precision().dtype());
//!     let loss = half.forward(x).cast(DType::F32).powi_scalar(2).mean();
//!     let grads = amp.backward(loss);
//!     let (stepped, report) = amp.step(&mut optimizer, 0.1, model, &half, grads);
//!     model = stepped;
//!     // A step whose gradients overflowed at this scale was skipped, the scale lowered.
//!     println!("loss scale {}, skipped: {}", report.loss_scale, report.skipped);
//! }
//! assert_eq!(model.weight.val().dtype(), DType::F32, "the masters stay fp32");
//! ```

use burn::module::Module;
use burn::optim::{GradientsParams, LearningRate, ModuleOptimizer};
use burn::tensor::{DType, Gradients, Tensor};

use crate::fp16::{wrap_fp16_model, Fp16Module, Precision};
use crate::grads::{self, GradClip};
use memsave_common::scaler::{LossScaler, ScaleMode};

/// What one [`MixedPrecision::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// A gradient overflowed (inf or NaN): the masters were left as they were.
    pub skipped: bool,
    /// The loss scale the step's backward ran with.
    pub loss_scale: f64,
    /// The global norm of the unscaled gradients, before clipping (the clipping's `p`, else 2);
    /// `None` when no parameter got a gradient.
    pub grad_norm: Option<f64>,
}

/// Mixed precision with fp32 master weights for a user's own loop (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct MixedPrecision {
    precision: Precision,
    scaler: LossScaler,
    grad_clip: Option<GradClip>,
}

impl MixedPrecision {
    /// The forward in `precision`, the loss scaled by `scaler`.
    pub fn new(precision: Precision, scaler: LossScaler) -> Self {
        MixedPrecision {
            precision,
            scaler,
            grad_clip: None,
        }
    }

    /// PyTorch's defaults: f16 with a dynamic scale from 2^16 (factor 2, window 2000; MMCV's
    /// 2^32 would skip the first steps), bf16 without scaling (fp32's range).
    pub fn for_precision(precision: Precision) -> Self {
        let scaler = match precision {
            Precision::F16 => LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2000),
            Precision::Bf16 => LossScaler::new(1.0, ScaleMode::Static, 2.0, 2000),
        }
        .expect("PyTorch's defaults are valid");
        MixedPrecision::new(precision, scaler)
    }

    /// The same, clipping the unscaled gradients by their global norm before each step.
    pub fn with_grad_clip(mut self, grad_clip: GradClip) -> Self {
        self.grad_clip = Some(grad_clip);
        self
    }

    /// The half type of the forward.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The loss scaler (its state is serialisable, for a checkpoint of the loop).
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// The loss scaler restored from `state`, the scaler's own serialisation (a snapshot's
    /// `"fp16"` hook: `Snapshot::with_hook("fp16", amp.scaler())` wrote it); checked as a
    /// configured scaler is, so a damaged state is an error naming the field.
    pub fn restore_scaler(&mut self, state: &serde_json::Value) -> crate::Result<()> {
        self.scaler = LossScaler::from_state(state.clone())?;
        Ok(())
    }

    /// The half copy of `masters` the forward runs on (`wrap_fp16_model` on a clone: flags on,
    /// parameters half except fp32 islands, the same parameter ids). Make it afresh each step,
    /// after the previous step changed the masters.
    pub fn half_model<M: Fp16Module + Clone>(&self, masters: &M) -> M {
        wrap_fp16_model(masters.clone(), self.precision)
    }

    /// Backward of `loss` times the loss scale, in fp32 (so that the scaled loss itself cannot
    /// overflow). Compute the loss in fp32: the gradient that reaches an f16 loss is the loss
    /// scale itself, in f16, which overflows past 65504 (PyTorch's default scale is 65536), so
    /// such a step is skipped; an f16 loss is warned about (a `memsave` event).
    pub fn backward(&self, loss: Tensor<1>) -> Gradients {
        let scale = self.scaler.loss_scale();
        if loss.dtype() == DType::F16 && scale > 65504.0 {
            tracing::warn!(
                target: "memsave",
                "the loss is f16: its gradient, the loss scale {scale}, overflows f16 and the step \
                 will be skipped; compute the loss in fp32 (`#[force_fp32]` on the loss, \
                 `out_fp32` on the forward, or `.cast(DType::F32)`)"
            );
        }
        crate::checkpoint::backward(loss.cast(DType::F32).mul_scalar(scale))
    }

    /// Steps `optimizer` on the fp32 `masters` with the gradients of `half` (the copy
    /// [`half_model`](Self::half_model) made this step), unscaled in fp32; or, when one
    /// overflowed, leaves the masters as they were and lowers the scale (MMCV's warning is a
    /// `memsave` event). Updates the scale either way.
    pub fn step<M: Module>(
        &mut self,
        optimizer: &mut ModuleOptimizer,
        lr: LearningRate,
        masters: M,
        half: &M,
        grads: Gradients,
    ) -> (M, StepReport) {
        let loss_scale = self.scaler.loss_scale();
        let mut grads = GradientsParams::from_grads(grads, half);
        grads::unscale_to_masters(&masters, &mut grads, 1.0 / loss_scale);
        let norm_type = self.grad_clip.map_or(2.0, |clip| clip.norm_type);
        let grad_norm = grads::global_norm(&masters, &grads, norm_type);
        let overflow = grad_norm.is_some_and(|norm| !norm.is_finite());
        if overflow {
            if let Some(advice) = self.scaler.first_overflow_advice(true) {
                tracing::warn!(target: "memsave", "{advice}");
            }
            self.scaler.update_scale(true);
            let after = match self.scaler.mode() {
                ScaleMode::Dynamic => {
                    format!("the loss scale lowered to {}", self.scaler.loss_scale())
                }
                ScaleMode::Static => "the loss scale is static and stays".to_string(),
            };
            tracing::warn!(
                target: "memsave",
                "gradient overflow (inf or NaN) at loss scale {loss_scale}; the step is skipped \
                 and {after}"
            );
            let report = StepReport {
                skipped: true,
                loss_scale,
                grad_norm,
            };
            return (masters, report);
        }
        if let Some(clip) = &self.grad_clip {
            grads::clip_by_global_norm(&masters, &mut grads, clip);
        }
        let masters = optimizer.step(lr, masters, grads);
        self.scaler.update_scale(false);
        let report = StepReport {
            skipped: false,
            loss_scale,
            grad_norm,
        };
        (masters, report)
    }
}
