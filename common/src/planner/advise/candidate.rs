//! One combination considered ([`Candidate`]): its checkpoint plan under the budget and its
//! description in words.

use serde::{Deserialize, Serialize};

use super::overrides::overrides;
use super::setting::Setting;
use super::staging::{OffloadCost, Staging};
use crate::planner::{plan, ModelKeys, Plan, Profile};

/// One combination considered.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Candidate {
    /// In words (`mixed precision + checkpoint 5 of 16 segments`).
    pub label: String,
    /// The setting.
    pub setting: Setting,
    /// The checkpointed segments' paths (empty: none needed).
    pub checkpoint: Vec<String>,
    /// Predicted peak, bytes (the device's).
    pub peak: u64,
    /// Predicted host bytes for staging (offloaded activations, the optimizer's masters and
    /// state on the host); 0 without offload.
    #[serde(default)]
    pub host_bytes: u64,
    /// Predicted optimizer-step time, seconds.
    pub seconds: f64,
    /// Whether it fits the budget (and, with offload, the host budget).
    pub fits: bool,
    /// How it changes the training, if it does (`the batch is 2, not 4`).
    pub changes_training: Option<String>,
    /// Whether the checkpoint search was exact.
    pub exact: bool,
    /// Whether it changes the arithmetic beyond rounding (8-bit optimizer state).
    #[serde(default)]
    pub approximate: bool,
    /// The config overrides that apply it (`--set` arguments).
    pub sets: Vec<String>,
}

/// Where an offload setting's time and host bytes come from: the staging the device gives, the
/// profile of the same setting without offload (its compute) and what the offload profiles
/// measured.
pub(super) struct Offload<'a> {
    pub staging: &'a Staging,
    pub compute: &'a Profile,
    pub cost: OffloadCost,
}

pub(super) fn candidate(
    current: &Setting,
    setting: &Setting,
    profile: &Profile,
    budget: u64,
    keys: &ModelKeys,
    offload: Option<Offload<'_>>,
) -> Candidate {
    // Activation offload is planned with every segment checkpointed: the profile measured it
    // so, and a segment left unchecked would keep its input on the device, which the profile's
    // kept bytes do not count.
    let every_segment = setting.offload_activations && offload.is_some();
    let planned = if every_segment {
        let all = vec![true; profile.segments.len()];
        let peak = profile.predict_peak(&all);
        if peak <= budget {
            Ok(Plan {
                paths: profile.segments.iter().map(|s| s.path.clone()).collect(),
                peak,
                seconds: profile.predict_seconds(&all),
                checkpointed: all,
                exact: true,
            })
        } else {
            Err(())
        }
    } else {
        plan(profile, budget).map_err(|_| ())
    };
    let (mut plan, mut fits) = match planned {
        Ok(plan) => (plan, true),
        Err(_) => {
            let all = vec![true; profile.segments.len()];
            (
                Plan {
                    paths: profile.segments.iter().map(|s| s.path.clone()).collect(),
                    peak: profile.predict_peak(&all),
                    seconds: profile.predict_seconds(&all),
                    checkpointed: all,
                    exact: true,
                },
                false,
            )
        }
    };
    let mut host_bytes = 0;
    if let Some(offload) = &offload {
        plan.seconds = offload.compute.predict_seconds(&plan.checkpointed)
            + offload.staging.copy_seconds(
                setting,
                offload.compute,
                &plan.checkpointed,
                &offload.cost,
            );
        host_bytes = Staging::host_bytes(
            setting,
            profile.trainable,
            &plan.checkpointed,
            &offload.cost,
        );
        fits &= host_bytes <= offload.staging.host_budget;
    }
    let mut words = Vec::new();
    if setting.fp16 && !current.fp16 {
        words.push("mixed precision".to_string());
    }
    if setting.cumulative > 1 {
        words.push(format!(
            "accumulation {} x {}",
            setting.micro_batch, setting.cumulative
        ));
    }
    if current.adam && !setting.adam {
        words.push("SGD instead of Adam(W)".to_string());
    }
    if setting.step_in_backward && !current.step_in_backward {
        words.push(if setting.passes() > 1 {
            "step in backward (two passes)".to_string()
        } else {
            "step in backward".to_string()
        });
    }
    if setting.int8_state && !current.int8_state {
        words.push("8-bit optimizer state (approximate)".to_string());
    }
    if setting.offload_activations && !current.offload_activations {
        words.push("activation offload".to_string());
    }
    if setting.offload_optimizer && !current.offload_optimizer {
        words.push("optimizer offload".to_string());
    }
    if setting.batch() != current.batch() {
        words.push(format!("batch {}", setting.batch()));
    }
    let checked = plan.paths.len();
    if checked > 0 {
        words.push(format!(
            "checkpoint {checked} of {} segments",
            profile.segments.len()
        ));
    }
    if words.is_empty() {
        words.push("as it stands".to_string());
    }
    let mut changes = Vec::new();
    if setting.batch() != current.batch() {
        changes.push(format!(
            "the batch is {}, not {} (a different training: scale the learning rate)",
            setting.batch(),
            current.batch()
        ));
    }
    if current.adam && !setting.adam {
        changes.push("SGD with momentum 0.9 replaces Adam(W) (a different optimizer)".to_string());
    }
    if setting.int8_state && !current.int8_state {
        changes.push(
            "the optimizer's state is kept in 8 bits (approximate: measure its training cost)"
                .to_string(),
        );
    }
    Candidate {
        label: words.join(" + "),
        setting: *setting,
        sets: overrides(current, setting, &plan.paths, keys),
        checkpoint: plan.paths,
        peak: plan.peak,
        host_bytes,
        seconds: plan.seconds,
        fits,
        changes_training: (!changes.is_empty()).then(|| changes.join("; ")),
        exact: plan.exact,
        approximate: setting.int8_state && !current.int8_state,
    }
}
