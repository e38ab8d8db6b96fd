//! The memory planner's Burn-free parts: a step's measured [`Profile`] (from the recorder's
//! events, [`crate::checkpoint::profile`]), the cheapest checkpoint set under a budget ([`plan`],
//! exact by dynamic programming), the advice when checkpointing cannot fit ([`advise`]), and
//! `memory_budget` / `with_cp` as a config writes them ([`budget`]), one step recorded as a
//! profile ([`recording`]) and `with_cp = "dynamic"`'s engine ([`dynamic`]). Each runtime measures the
//! step and applies the plan (its hooks: `AutoPlanHook`, `DynamicHook`, `ProfileHook`).

pub mod advise;
pub mod budget;
pub mod dynamic;
pub mod profile;
pub mod recording;
pub mod solve;

pub use budget::{Budget, ModelKeys, WithCp};
pub use dynamic::{DynamicMemory, IntervalFigures, StepEnd};
pub use profile::{GradientEstimate, Profile, SegmentProfile, Window};
pub use recording::{no_staging, Recording, Staged};
pub use solve::{plan, BelowFloor, Plan};
