//! The optimizer hook's frozen weights held compressed (`OptimizerHook::with_frozen_dtype`,
//! `[optimizer] frozen_dtype`): compressed once before the run, on the weights the run trains,
//! in the type the forward can read (see [`crate::frozen`]).

use super::OptimizerHook;
use crate::frozen::{compress_frozen, FrozenDtype};
use crate::train::{TrainModel, TrainState};
use crate::{Error, Result};

impl OptimizerHook {
    /// The same hook holding the model's frozen weights (float parameters of rank 2 or more
    /// without `require_grad`) as `dtype` from the start of the run: `int8` (Burn's
    /// quantization, an fp32 scale per block of at most 256 values) for an fp32 forward,
    /// `bf16` for a half forward (mixed precision, 16-bit weights), where no fp32 copy of them
    /// is kept. `None`: as they are.
    pub fn with_frozen_dtype(mut self, dtype: Option<FrozenDtype>) -> Self {
        self.frozen = dtype;
        self
    }

    /// The type frozen weights are held in, where they are compressed.
    pub fn frozen_dtype(&self) -> Option<FrozenDtype> {
        self.frozen
    }

    /// Before the run, after the model is cast to its precision: the frozen weights compressed,
    /// the forward copy made again from them.
    pub(super) fn compress_frozen<M: TrainModel>(&self, state: &mut TrainState<M>) -> Result<()> {
        let Some(dtype) = self.frozen else {
            return Ok(());
        };
        let half = self
            .mixed
            .as_ref()
            .map(|mixed| mixed.precision)
            .or(self.weights16);
        match (dtype, half) {
            (FrozenDtype::Int8, Some(precision)) => {
                return Err(Error::invalid(
                    "optimizer.frozen_dtype",
                    format!(
                        "\"int8\" needs an fp32 forward on Burn 0.22, and this run's forward is \
                         {precision}: Burn dequantizes an int8 weight into the device's float \
                         type (fp32), which a {precision} layer cannot take. Use \"bf16\" (the \
                         frozen weights held in the half type, with no fp32 copy), or train in \
                         fp32"
                    ),
                ));
            }
            (FrozenDtype::Bf16, None) => {
                return Err(Error::invalid(
                    "optimizer.frozen_dtype",
                    "\"bf16\" needs a half forward on Burn 0.22 (mixed precision or 16-bit \
                     weights): Burn's layers cannot take a bf16 weight in an fp32 forward. Use \
                     \"int8\" (Burn's quantization, which every layer reads), or train in half \
                     precision",
                ));
            }
            _ => {}
        }
        let (model, figures) = compress_frozen(state.model.clone(), dtype);
        state.model = model;
        if figures.count == 0 {
            state.warn(format!(
                "`optimizer.frozen_dtype = \"{dtype}\"`: the model has no frozen weight (no \
                 parameter of rank 2 or more without `require_grad`): nothing is compressed"
            ));
        } else {
            tracing::info!(
                target: "memsave",
                "{} frozen weights held in {dtype}: {:.1} MiB (were {:.1} MiB)",
                figures.count,
                figures.held_bytes as f64 / (1 << 20) as f64,
                figures.before_bytes as f64 / (1 << 20) as f64,
            );
        }
        self.refresh_forward(state);
        Ok(())
    }
}
