//! The cheapest combination of strategies that fits a budget: a checkpoint set, mixed
//! precision, accumulation (batch b as b/k x k), the optimizer's step in backward, 8-bit
//! optimizer state (approximate: only when allowed), SGD instead of Adam, and, last, a smaller
//! batch, each predicted from measured profiles.
//!
//! A combination is predicted from the measured profile nearest to it (same precision, the
//! nearest batch per micro-step): the bytes above the resident ones in every window but the
//! optimizer step's, and every segment's kept bytes, scale with the batch; under accumulation
//! the gradient sums stay live through every micro-step (fp32, the size of the trainable
//! weights, beside the half gradients under mixed precision) and the step takes k micro-steps;
//! SGD (with momentum) keeps one copy of the trainable weights fewer than Adam. The step in
//! backward is predicted from a profile measured with it (its windows hold next to no
//! gradient); under clipping or mixed precision it takes two passes, the first's time measured
//! or, from a one-pass profile, its forward and backward again. 8-bit state keeps a quarter of
//! the state's bytes (plus a scale per block), and costs the step the time measured for it.
//! A micro-batch's time is fitted as a fixed part plus a part per sample on the config's batch
//! and half of it (both measured), so that a smaller micro-batch is not predicted faster than
//! it runs. Then the checkpoint set is planned on that prediction.
//!
//! On a device that can stage (not the CPU), activation offload and optimizer offload are
//! offered where profiles were measured with them: their device bytes from those profiles,
//! their host bytes against the host budget and their time from the link's bandwidth
//! ([`Staging`]).

mod candidate;
mod overrides;
mod rank;
mod scale;
mod setting;
mod staging;

pub use candidate::Candidate;
pub use overrides::overrides;
pub use rank::advise;
pub use scale::{scale, scale_timed, BatchTime, INT8_STATE_SHARE};
pub use setting::{Measured, Setting};
pub use staging::Staging;
