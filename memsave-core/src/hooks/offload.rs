//! CPU staging as a policy: `[offload]` in the config, and the hook that switches activation
//! offload ([`crate::checkpoint::offload`]) on for a run and off after it. Optimizer offload is
//! a place of the optimizer hook's step (`OptimizerHook::with_optimizer_offload`).
//!
//! ```toml
//! [offload]
//! optimizer = true          # optimizer state and fp32 masters in host memory, stepped there
//! activations = true        # checkpointed segments' kept inputs wait in host memory
//! min_bytes = "1KiB"        # smaller tensors stay on the device
//! max_in_flight = "256MiB"  # device bytes whose copy to the host may be under way at once
//! prefetch = 2              # segments brought back ahead of the recomputation
//! ```

use burn::tensor::backend::AutodiffBackend;
use serde::Deserialize;

use crate::checkpoint::offload::{self, ActivationOffload};
use crate::planner::Budget;
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// `[offload]`: what goes to host memory (see the module docs). Unset values take
/// [`ActivationOffload::default`]'s.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadSection {
    /// The inputs that checkpointed segments keep for their recomputation, to host memory
    /// during the forward and back before the recomputation (checkpointing must be on).
    #[serde(default)]
    pub activations: bool,
    /// The optimizer's state and the fp32 master weights in host memory, each parameter stepped
    /// there as its gradient is final ([`crate::hooks::OptimizerHook::with_optimizer_offload`]).
    #[serde(default)]
    pub optimizer: bool,
    /// Tensors smaller than this stay on the device (bytes, or `"1KiB"`).
    #[serde(default)]
    pub min_bytes: Option<Bytes>,
    /// The most device bytes whose copy to the host may be under way at once.
    #[serde(default)]
    pub max_in_flight: Option<Bytes>,
    /// How many segments backward brings back ahead of the one it recomputes.
    #[serde(default)]
    pub prefetch: Option<usize>,
}

impl OffloadSection {
    /// The activation offload asked for, if any.
    pub fn activations(&self) -> Option<ActivationOffload> {
        let default = ActivationOffload::default();
        self.activations.then(|| ActivationOffload {
            min_bytes: self.min_bytes.map_or(default.min_bytes, |b| b.0),
            max_in_flight: self.max_in_flight.map_or(default.max_in_flight, |b| b.0),
            prefetch: self.prefetch.unwrap_or(default.prefetch),
        })
    }
}

/// A byte count: a number, or a string with a unit (`"1KiB"`, `"256MiB"`, `"2GB"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        let raw = Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("a size is bytes: a number (1024) or a string (\"1KiB\")")
        })?;
        match raw {
            Raw::Number(bytes) => Ok(Bytes(bytes)),
            Raw::Text(text) => match Budget::parse(&text, "size") {
                Ok(Budget::Bytes(bytes)) => Ok(Bytes(bytes)),
                _ => Err(serde::de::Error::custom(format!(
                    "`{text}` is not a size: give bytes (1024, \"1KiB\", \"256MiB\", \"2GB\")"
                ))),
            },
        }
    }
}

/// The runs of this process whose [`OffloadHook`] holds its setting in force, and what was in
/// force before the first of them (data-parallel peers on threads of one process share it).
type InForce = (usize, Option<(Option<ActivationOffload>, Option<u64>)>);
static IN_FORCE: std::sync::Mutex<InForce> = std::sync::Mutex::new((0, None));

/// Switches activation offload on for the run (before its first iteration) and back to what it
/// was after it. On a backend whose tensors are host memory (Flex) it says so once and the run
/// goes on without it.
pub struct OffloadHook {
    setting: ActivationOffload,
    /// The host bytes CPU staging may use (`[memory] host_budget`), if bounded.
    host_budget: Option<u64>,
    /// Whether optimizer offload keeps its state and masters (and, accumulating, the sums) in
    /// the same budget: `Some(accumulates)`.
    optimizer_on_host: Option<bool>,
    /// Whether each data-parallel peer keeps only its part of the state (ZeRO 1 or 2).
    sharded: bool,
    /// Whether this hook's run holds the setting in force ([`IN_FORCE`]).
    active: bool,
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
            active: false,
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

    /// Puts the setting and `limit` in force, unless another run of this process (a peer on
    /// another thread) has already.
    fn put_in_force(&mut self, limit: Option<u64>) {
        let mut in_force = IN_FORCE.lock().unwrap_or_else(|e| e.into_inner());
        if in_force.0 == 0 {
            in_force.1 = Some((
                offload::set_activation_offload(Some(self.setting)),
                offload::set_host_limit(limit),
            ));
        }
        in_force.0 += 1;
        self.active = true;
    }

    /// The last run of this process to end restores what was in force before the first.
    fn restore(&mut self) {
        if !std::mem::take(&mut self.active) {
            return;
        }
        let mut in_force = IN_FORCE.lock().unwrap_or_else(|e| e.into_inner());
        in_force.0 -= 1;
        if in_force.0 == 0 {
            if let Some((setting, limit)) = in_force.1.take() {
                offload::set_activation_offload(setting);
                offload::set_host_limit(limit);
            }
            offload::fail_next_prefetch(None);
        }
    }

    /// What the host budget leaves activation offload: the budget less optimizer offload's
    /// masters, state and sums, for every peer of this process (the same bytes the check
    /// before the run counts). The limit is the process's: its peers share it.
    fn host_limit<B: AutodiffBackend, M: TrainModel<B>>(
        &self,
        state: &TrainState<B, M>,
    ) -> Option<u64> {
        use crate::train::params::{OffloadedOptimizer, OnThisHost};
        let budget = self.host_budget?;
        let optimizer = match self.optimizer_on_host {
            Some(accumulates) => OffloadedOptimizer::of(
                &state.model,
                state.optimizer_state_per_weight,
                accumulates,
                &OnThisHost::of(&state.peer, self.sharded),
            )
            .total(),
            None => 0,
        };
        Some(budget.saturating_sub(optimizer))
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
                eprintln!(
                    "{}",
                    offload::nothing_to_save::<B::InnerBackend>("offload.activations")
                );
                return Ok(());
            }
            offload::StagingSupport::Unknown(why) => {
                return Err(Error::invalid("offload.activations", why));
            }
        }
        let limit = self.host_limit(state);
        self.put_in_force(limit);
        offload::reset_offload_stats();
        Ok(())
    }

    fn after_iter(&mut self, _state: &mut TrainState<B, M>) -> Result<()> {
        if self.active && !self.checked {
            self.checked = true;
            if offload::offload_stats().segments == 0 {
                eprintln!(
                    "memsave: warning: `offload.activations` is on, but the first iteration \
                     offloaded nothing: activation offload moves the inputs that checkpointed \
                     segments keep, and no segment was checkpointed with an input of at least \
                     {} bytes (switch checkpointing on: `with_cp = true`)",
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
