//! The memory planner: checkpoint only the segments a memory budget needs, at the least
//! recomputation time, and say what else would fit when checkpointing cannot.
//!
//! - [`profile`]: one step with every segment checkpointed, measured ([`Profile`]): per segment
//!   the bytes it would keep and the time its recomputation costs, per window of the step its
//!   peak; it predicts the peak and time of any checkpoint set.
//! - [`solve`]: the cheapest set under a budget ([`plan`]), exact by dynamic programming.
//! - [`advise`]: the cheapest combination with mixed precision, accumulation, SGD and a smaller
//!   batch ([`advise::advise`]).
//! - [`AutoPlanHook`]: `with_cp = "auto"` in training: the first step is the profile, the
//!   plan applies from the second, and the measured peaks of the next steps are checked
//!   against the budget (segments are added if one is over).
//! - [`budget`]: `memory_budget` and `with_cp` as a config writes them.

pub use memsave_common::planner::{advise, budget, profile, solve};

mod auto;
pub mod dynamic;
mod profile_hook;
mod step_meter;

pub use auto::AutoPlanHook;
pub use dynamic::DynamicHook;
pub use memsave_common::planner::{
    plan, BelowFloor, Budget, GradientEstimate, ModelKeys, Plan, Profile, SegmentProfile, Window,
    WithCp,
};
pub use profile_hook::ProfileHook;
pub use step_meter::StepMeter;
