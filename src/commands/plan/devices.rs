//! `--devices N`: one data-parallel peer's share of the unplanned breakdown.

use serde::Serialize;

use super::breakdown::Breakdown;

/// One data-parallel peer's share of the unplanned breakdown (`--devices N` above 1): ZeRO
/// stage 1 holds 1/N of the optimizer state, stage 2 also 1/N of the gradients; the rest is
/// every peer's. Estimated from the measured parts, at the moment of the measured peak.
#[derive(Clone, Debug, Serialize)]
pub struct PerPeer {
    pub peers: usize,
    pub zero_stage: u8,
    pub gradients: u64,
    pub gradients_at_backward_end: u64,
    pub optimizer_state: u64,
    pub peak: u64,
}

impl PerPeer {
    pub(super) fn of(
        breakdown: &Breakdown,
        peers: usize,
        stage: memsave::parallel::ZeroStage,
    ) -> Self {
        use memsave::parallel::ZeroStage;
        let share = |bytes: u64, sharded: bool| {
            if sharded {
                bytes.div_ceil(peers.max(1) as u64)
            } else {
                bytes
            }
        };
        let state_sharded = stage >= ZeroStage::OptimizerState;
        let grads_sharded = stage >= ZeroStage::Gradients;
        let optimizer_state = share(breakdown.optimizer_state, state_sharded);
        let gradients = share(breakdown.gradients, grads_sharded);
        let peak = breakdown.peak
            - (breakdown.optimizer_state - optimizer_state)
            - (breakdown.gradients - gradients);
        PerPeer {
            peers,
            zero_stage: stage.number(),
            gradients,
            gradients_at_backward_end: share(breakdown.gradients_at_backward_end, grads_sharded),
            optimizer_state,
            peak,
        }
    }
}
