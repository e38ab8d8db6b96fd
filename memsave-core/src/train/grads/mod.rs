//! The operations the optimizer hook applies to a step's gradients, each written once: the
//! backward pass (scaled, accumulating, joining the recompute threads), unscaling, the global
//! norm and clipping, the cast onto fp32 master weights, and the parameters without gradient.

mod map;
mod missing;
mod norm;
mod pass;
mod seed;

pub use map::scale;
pub(crate) use map::{into_chunks, to_f32};
pub(crate) use missing::{params_without, params_without_grad};
#[cfg_attr(not(feature = "burn-train"), allow(unused_imports))]
pub(crate) use norm::norm_and_clip;
pub(crate) use norm::{combine_norm, norm_part};
pub use norm::{global_norm, GradClip};
pub use pass::{accumulate, backward};
pub(crate) use pass::{add_to_sum, share};
pub(crate) use seed::seed_with;

use burn::prelude::Backend;
use burn::tensor::{DType, ElementConversion, Tensor};

/// The value of a one-element tensor, as f64.
pub(crate) fn scalar<B: Backend>(value: &Tensor<B, 1>) -> f64 {
    value.clone().cast(DType::F32).into_scalar().elem::<f32>() as f64
}
