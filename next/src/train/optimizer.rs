//! The optimizer a config describes ([`OptimizerSpec`], MMCV's names), as Burn 0.22's module
//! optimizer: SGD, Adam or AdamW with their state in fp32 or 8 bits (memsave's `Sgd8` and
//! `Adam8`, Burn's rules bit for bit in fp32), wrapped by `Weights16` where the weights are
//! kept in 16 bits.

use burn::optim::{ModuleOptimizer, Optimizer};

use crate::optim8::{Adam8, Sgd8};
use crate::weights16::Weights16;
use crate::Result;

pub use memsave_common::optim::{OptimizerKind, OptimizerSpec, StateDtype};

/// The module optimizer `spec` describes; an error names the setting at fault. (Its frozen
/// weights' type is the optimizer hook's: `OptimizerHook::with_frozen_dtype`.)
pub fn optimizer(spec: &OptimizerSpec) -> Result<ModuleOptimizer> {
    spec.validate()?;
    let eight_bit = spec.state_dtype == StateDtype::Int8;
    match &spec.kind {
        OptimizerKind::Sgd {
            momentum,
            weight_decay,
            nesterov,
        } => {
            let mut sgd = Sgd8::new().with_eight_bit(eight_bit);
            if *momentum > 0.0 {
                // PyTorch's SGD: no dampening.
                sgd = sgd.with_momentum(*momentum, 0.0, *nesterov);
            }
            if *weight_decay > 0.0 {
                sgd = sgd.with_weight_decay(*weight_decay as f32);
            }
            sgd.validate().map_err(|error| error.within("optimizer"))?;
            Ok(wrapped(sgd, spec))
        }
        OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => {
            let ((beta_1, beta_2), eps, weight_decay) = spec.kind.adam_settings();
            let adam = match spec.kind {
                OptimizerKind::AdamW { .. } => Adam8::adamw(),
                _ => Adam8::adam(),
            }
            .with_betas(beta_1 as f32, beta_2 as f32)
            .with_epsilon(eps as f32)
            .with_weight_decay(weight_decay as f32)
            .with_eight_bit(eight_bit);
            adam.validate().map_err(|error| error.within("optimizer"))?;
            Ok(wrapped(adam, spec))
        }
    }
}

/// `rule` over a module, each weight widened for its step and rounded back where the weights
/// are kept in 16 bits.
fn wrapped<O: Optimizer>(rule: O, spec: &OptimizerSpec) -> ModuleOptimizer {
    if !spec.weights.is_compressed() {
        return ModuleOptimizer::from(rule);
    }
    Weights16::new(rule)
        .with_rounding(spec.weights.rounding)
        .with_seed(spec.weights.seed)
        .init()
}
