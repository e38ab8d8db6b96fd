//! A static plan for the largest input against `"dynamic"` over the sizes of multi-scale
//! training, as `memsave plan` compares them.

use super::predict::*;
use crate::planner::{plan, Profile};

/// A predicted figure over the input sizes of multi-scale training.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct OverSizes {
    /// The mean predicted step time, seconds.
    pub mean_seconds: f64,
    /// The highest predicted step peak, bytes.
    pub max_peak: u64,
}

/// What `memsave plan` says of a multi-scale config: a static plan made for the largest input
/// against `"dynamic"` and against checkpointing every segment, each predicted over the input
/// sizes the training draws.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MultiScaleComparison {
    /// The budget, bytes.
    pub budget: u64,
    /// How many sizes were drawn, and the smallest's share of the largest's input.
    pub draws: usize,
    /// See `draws`.
    pub smallest_ratio: f64,
    /// The checkpoint set planned for the largest input, predicted at every size (`None`: the
    /// largest does not fit the budget whatever is checkpointed).
    pub static_plan: Option<OverSizes>,
    /// Its segments checkpointed, of how many.
    pub static_checkpointed: (usize, usize),
    /// Each size's own plan (from the nearer profile).
    pub dynamic: OverSizes,
    /// Every segment checkpointed.
    pub all_checkpointed: OverSizes,
}

/// Compares, over input sizes `ratios` (each a share of the largest input's elements), a static
/// plan made for the largest (`largest`, profiled there) with `"dynamic"` (each size planned
/// from the nearer of `largest` and `smaller`, a profile at the share `smaller.1`) and with
/// every segment checkpointed, under `budget` bytes.
pub fn compare_multiscale(
    largest: &Profile,
    smaller: Option<(&Profile, f64)>,
    ratios: &[f64],
    budget: u64,
) -> MultiScaleComparison {
    let nearest = |r: f64| -> Profile {
        match smaller {
            Some((profile, at)) if (r / at).ln().abs() < r.ln().abs() => scaled(profile, r / at),
            _ => scaled(largest, r),
        }
    };
    let n = largest.segments.len();
    let all = vec![true; n];
    let fixed = plan(largest, budget).ok().map(|p| p.checkpointed);
    let (mut dynamic, mut every, mut fixed_over) = (Vec::new(), Vec::new(), Vec::new());
    for &r in ratios {
        let at = nearest(r);
        let chosen = plan(&at, budget)
            .map(|p| p.checkpointed)
            .unwrap_or_else(|_| all.clone());
        dynamic.push((at.predict_seconds(&chosen), at.predict_peak(&chosen)));
        every.push((at.predict_seconds(&all), at.predict_peak(&all)));
        if let Some(set) = &fixed {
            fixed_over.push((at.predict_seconds(set), at.predict_peak(set)));
        }
    }
    let over = |figures: &[(f64, u64)]| OverSizes {
        mean_seconds: figures.iter().map(|f| f.0).sum::<f64>() / figures.len().max(1) as f64,
        max_peak: figures.iter().map(|f| f.1).max().unwrap_or(0),
    };
    MultiScaleComparison {
        budget,
        draws: ratios.len(),
        smallest_ratio: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        static_plan: fixed.as_ref().map(|_| over(&fixed_over)),
        static_checkpointed: (
            fixed
                .as_ref()
                .map_or(n, |f| f.iter().filter(|c| **c).count()),
            n,
        ),
        dynamic: over(&dynamic),
        all_checkpointed: over(&every),
    }
}
