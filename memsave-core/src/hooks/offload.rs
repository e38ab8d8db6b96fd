//! CPU staging as a policy: the hook that switches activation offload
//! ([`crate::checkpoint::offload`]) on for a run and off after it (the config's `[offload]`:
//! [`crate::config::OffloadSection`]). Optimizer offload is a place of the optimizer hook's
//! step (`OptimizerHook::with_optimizer_offload`).

use burn::tensor::backend::AutodiffBackend;

use crate::checkpoint::offload::{self, ActivationOffload};
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// Switches activation offload on in the run (before its first iteration) and back to what it
/// was after it: in the run's context ([`crate::run`]), which data-parallel peers on threads of
/// one process share, so that its host limit is the host's. On a backend whose tensors are host
/// memory (Flex) it says so once and the run goes on without it.
pub struct OffloadHook {
    setting: ActivationOffload,
    /// The host bytes CPU staging may use (`[memory] host_budget`), if bounded.
    host_budget: Option<u64>,
    /// Whether optimizer offload keeps its state and masters (and, accumulating, the sums) in
    /// the same budget: `Some(accumulates)`.
    optimizer_on_host: Option<bool>,
    /// Whether each data-parallel peer keeps only its part of the state (ZeRO 1 or 2).
    sharded: bool,
    /// Whether this hook holds the setting in force in its run ([`offload::hold`]), and which
    /// run.
    active: Option<crate::RunContext>,
    /// Whether the first iteration's offload was looked at.
    checked: bool,
}

impl OffloadHook {
    /// A hook that puts `setting` in force for the run.
    pub fn new(setting: ActivationOffload) -> Self {
        OffloadHook {
            setting,
            host_budget: None,
            optimizer_on_host: None,
            sharded: false,
            active: None,
            checked: false,
        }
    }

    /// Bounds the host bytes of CPU staging by `budget` (`None`: unbounded): past it, less what
    /// optimizer offload keeps on the host ([`OffloadHook::with_optimizer_offload`]), a step
    /// that would offload more ends the run with an error that names the segment and what to
    /// change ([`offload::set_host_limit`]).
    pub fn with_host_budget(mut self, budget: Option<u64>) -> Self {
        self.host_budget = budget;
        self
    }

    /// Whether optimizer offload shares the host budget: its fp32 masters and state, and, where
    /// it `accumulates` training alone, the group's fp32 sums.
    pub fn with_optimizer_offload(mut self, on: bool, accumulates: bool) -> Self {
        self.optimizer_on_host = on.then_some(accumulates);
        self
    }

    /// Whether, with data-parallel peers, each keeps the optimizer's state and masters of its
    /// own part only (ZeRO `stage` 1 or 2): what optimizer offload holds on this host is then
    /// the parts of this process's peers, else (the default) a whole set for each of them,
    /// never too few.
    pub fn with_zero_stage(mut self, stage: crate::parallel::ZeroStage) -> Self {
        self.sharded = stage != crate::parallel::ZeroStage::Off;
        self
    }

    /// Puts the setting and `limit` in force in the current run, unless another hook of the run
    /// (a peer on another thread) has already.
    fn put_in_force(&mut self, limit: Option<u64>) {
        offload::hold(self.setting, limit);
        self.active = Some(crate::run::current());
    }

    /// The last hook of the run to end restores what was in force before the first.
    fn restore(&mut self) {
        if let Some(run) = self.active.take() {
            offload::release(&run);
        }
    }

    /// What the host budget leaves activation offload: the budget less optimizer offload's
    /// masters, state and sums, for every peer of this process
    /// ([`crate::train::params::OffloadedOptimizer::within`], the check before a run). The
    /// limit is the run's: its peers share it.
    fn host_limit<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &TrainState<B, M>,
    ) -> Result<Option<u64>> {
        use crate::train::params::{OffloadedOptimizer, OnThisHost};
        let Some(budget) = self.host_budget else {
            return Ok(None);
        };
        match self.optimizer_on_host {
            Some(accumulates) => OffloadedOptimizer::of(
                &state.model,
                state.optimizer_state_per_weight,
                accumulates,
                &OnThisHost::of(&state.peer, self.sharded),
            )
            .within(budget)
            .map(Some),
            None => Ok(Some(budget)),
        }
    }
}

impl Drop for OffloadHook {
    fn drop(&mut self) {
        self.restore();
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for OffloadHook {
    fn name(&self) -> &'static str {
        "offload"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        match offload::staging::<B::InnerBackend>() {
            offload::StagingSupport::Possible => {}
            offload::StagingSupport::NothingToSave => {
                let notice = offload::nothing_to_save::<B::InnerBackend>("offload.activations");
                tracing::info!(target: "memsave", key = "offload.activations", "{notice}");
                return Ok(());
            }
            offload::StagingSupport::Unknown(why) => {
                return Err(Error::invalid("offload.activations", why));
            }
        }
        let limit = self.host_limit(state)?;
        self.put_in_force(limit);
        Ok(())
    }

    fn after_iter(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        if self.active.is_some() && !self.checked {
            self.checked = true;
            if offload::offload_stats().segments == 0 {
                tracing::warn!(
                    target: "memsave",
                    key = "offload.activations",
                    min_bytes = self.setting.min_bytes,
                    "`offload.activations` is on, but the first iteration offloaded nothing: \
                     activation offload moves the inputs that checkpointed segments keep, and no \
                     segment was checkpointed with an input of at least {} bytes (switch \
                     checkpointing on: `with_cp = true`)",
                    self.setting.min_bytes
                );
            }
        }
        Ok(())
    }

    fn after_run(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        self.restore();
        Ok(())
    }
}
