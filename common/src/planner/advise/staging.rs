//! CPU staging in the advice: what the host and the link between it and the device give a
//! plan ([`Staging`]), and what an offload setting costs in host bytes and in seconds.
//!
//! The device bytes of an offload setting come from a profile measured with it (its windows
//! hold what offload leaves on the device). Its time is the time of the same setting without
//! offload plus the copies' time at the link's bandwidth, the part of it that the compute does
//! not hide:
//! - activation offload copies each checkpointed segment's input down during the forward and up
//!   before its recomputation, on helper threads: `max(0, A/bw - F/k) + max(0, A/bw - R/k)` for
//!   each of a step's `k + p - 1` micro-batch passes (`k` micro-batches, `p` passes of the
//!   group's last), with `A` the bytes offloaded in a micro-batch's pass (measured with every
//!   segment checkpointed: activation offload is planned with all of them), `F` the forward's
//!   seconds, `R` the recomputations' seconds;
//! - optimizer offload copies each gradient down and its new value up, both in the forward's
//!   precision (half under mixed precision, where the device keeps no fp32 weight), on the
//!   training thread, and steps on the host: `(n + 1) G/bw + H`, with `G` a gradient set's bytes
//!   (`T` the trainable bytes, or `T/2` in half), `H` the host's step measured in the profile
//!   and `n` the passes that copy gradients down: under accumulation every micro-batch adds its
//!   gradients to the sums on the host, and a norm pass reads them there (`n = k + p - 1`);
//!   without, the group's one step pass (`n = 1`, a norm pass reading the device's gradients).
//!   Beside the step in backward's compute (it taps as that does; the device's own update in
//!   that profile is left in though it does not run; each parameter's copy is a read that waits
//!   for the device, counted at the bandwidth only, without its latency).
//!
//! Host bytes: the offloaded inputs (measured) and, under optimizer offload, the fp32 masters,
//! the optimizer's state (8-bit state at its share) and, under accumulation, the group's fp32
//! sums.

use serde::{Deserialize, Serialize};

use super::scale::INT8_STATE_SHARE;
use super::setting::Setting;
use crate::planner::Profile;

/// What a device that can stage its tensors in host memory gives a plan (none on the CPU,
/// whose tensors are host memory already: the advice then offers no offload).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Staging {
    /// Host bytes a plan may use for staging (`[memory] host_budget`).
    pub host_budget: u64,
    /// Bytes a second between the device and host memory, each way.
    pub link_bytes_per_second: f64,
    /// Where the bandwidth comes from, in words (`measured before profiling` or
    /// `memory.link_bandwidth`).
    pub link_source: String,
}

/// What a setting with offload adds, from the profiles measured with it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct OffloadCost {
    /// Bytes of segment inputs copied to the host per micro-batch, every segment checkpointed.
    pub offloaded_bytes: u64,
    /// The host's optimizer step, seconds per optimizer step.
    pub host_step_seconds: f64,
}

impl Staging {
    /// The seconds `setting`'s copies add to a step whose compute `compute` predicts (a profile
    /// for the same setting without offload), with the segments `checkpointed`.
    pub(super) fn copy_seconds(
        &self,
        setting: &Setting,
        compute: &Profile,
        checkpointed: &[bool],
        cost: &OffloadCost,
    ) -> f64 {
        let bandwidth = self.link_bytes_per_second.max(1.0);
        let mut seconds = 0.0;
        if setting.offload_activations {
            // A micro-batch's copies against its share of the forward and recomputations;
            // every micro-batch copies once, the group's last once more under two passes.
            let micro_batches = setting.cumulative.max(1) as f64;
            let bytes = cost.offloaded_bytes as f64 * share(checkpointed);
            let recompute: f64 = compute
                .segments
                .iter()
                .zip(checkpointed)
                .filter(|(_, &on)| on)
                .map(|(s, _)| s.recompute_seconds)
                .sum();
            let copy = bytes / bandwidth;
            let exposed = (copy - compute.forward_seconds / micro_batches).max(0.0)
                + (copy - recompute / micro_batches).max(0.0);
            seconds += exposed * (micro_batches + setting.passes() as f64 - 1.0);
        }
        if setting.offload_optimizer {
            // `trainable` is fp32 bytes: each gradient goes down, and its new value comes up, in
            // the forward's precision (under mixed precision the device holds only the half
            // weights the forward runs on; the planner plans a run alone).
            let trainable = compute.trainable as f64;
            let gradients = if setting.fp16 {
                trainable / 2.0
            } else {
                trainable
            };
            let downs = match setting.cumulative {
                0 | 1 => 1,
                k => k + setting.passes() - 1,
            };
            let bytes = gradients * (downs + 1) as f64;
            seconds += bytes / bandwidth + cost.host_step_seconds;
        }
        seconds
    }

    /// The host bytes `setting` stages: the inputs offloaded (per micro-batch, a share for a
    /// smaller checkpoint set) and the optimizer's masters and state, and the group's sums
    /// under accumulation.
    pub(super) fn host_bytes(
        setting: &Setting,
        trainable: u64,
        checkpointed: &[bool],
        cost: &OffloadCost,
    ) -> u64 {
        let mut bytes = 0;
        if setting.offload_activations {
            bytes += (cost.offloaded_bytes as f64 * share(checkpointed)) as u64;
        }
        if setting.offload_optimizer {
            let state = (trainable * setting.state_copies()) as f64;
            let state = if setting.int8_state {
                state * INT8_STATE_SHARE
            } else {
                state
            };
            let sums = if setting.cumulative > 1 { trainable } else { 0 };
            bytes += trainable + state as u64 + sums;
        }
        bytes
    }
}

/// The share of the segments checkpointed (each one's input offloaded).
fn share(checkpointed: &[bool]) -> f64 {
    if checkpointed.is_empty() {
        return 0.0;
    }
    checkpointed.iter().filter(|&&on| on).count() as f64 / checkpointed.len() as f64
}
