//! The config overrides (`--set` arguments) that apply a combination.

use super::setting::Setting;
use crate::planner::ModelKeys;

/// The config overrides for `setting` (from `current`) and the checkpoint `paths`, the model's
/// own settings at its `keys`.
pub fn overrides(
    current: &Setting,
    setting: &Setting,
    paths: &[String],
    keys: &ModelKeys,
) -> Vec<String> {
    let mut sets = Vec::new();
    if setting.fp16 && !current.fp16 {
        sets.push("fp16.loss_scale=\"dynamic\"".to_string());
    }
    if setting.cumulative != current.cumulative {
        if setting.cumulative > 1 {
            sets.push("optimizer_config.type=\"GradientCumulativeOptimizerHook\"".to_string());
            sets.push(format!(
                "optimizer_config.cumulative_iters={}",
                setting.cumulative
            ));
        } else {
            sets.push("optimizer_config.type=\"OptimizerHook\"".to_string());
        }
    }
    if setting.micro_batch != current.micro_batch {
        sets.push(format!("{}={}", keys.batch, setting.micro_batch));
    }
    if current.adam && !setting.adam {
        sets.push("optimizer.type=\"SGD\"".to_string());
        sets.push("optimizer.momentum=0.9".to_string());
    }
    if setting.step_in_backward != current.step_in_backward {
        sets.push(format!(
            "optimizer_config.step_in_backward={}",
            setting.step_in_backward
        ));
    }
    if setting.int8_state != current.int8_state {
        let dtype = if setting.int8_state { "int8" } else { "fp32" };
        sets.push(format!("optimizer.state_dtype=\"{dtype}\""));
    }
    let quoted: Vec<String> = paths.iter().map(|p| format!("\"{p}\"")).collect();
    sets.push(format!("{}=[{}]", keys.with_cp, quoted.join(", ")));
    sets
}
