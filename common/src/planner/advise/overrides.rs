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
    if setting.offload_activations != current.offload_activations {
        sets.push(format!(
            "offload.activations={}",
            setting.offload_activations
        ));
    }
    if setting.offload_optimizer != current.offload_optimizer {
        sets.push(format!("offload.optimizer={}", setting.offload_optimizer));
    }
    let quoted: Vec<String> = paths.iter().map(|p| format!("\"{p}\"")).collect();
    sets.push(format!("{}=[{}]", keys.with_cp, quoted.join(", ")));
    sets.extend(keys.also_with_cp.iter().map(|key| format!("{key}=false")));
    sets
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A detector's plan names the neck and head by path: their own switches go off beside it,
    /// or a config that had them on would checkpoint them whatever the plan said.
    #[test]
    fn the_models_other_switches_go_off_beside_the_plans_paths() {
        let keys = ModelKeys {
            with_cp: "model.backbone.with_cp",
            batch: "data.samples_per_gpu",
            also_with_cp: &["model.neck.with_cp", "model.bbox_head.with_cp"],
        };
        let setting = Setting {
            fp16: false,
            micro_batch: 2,
            cumulative: 1,
            adam: false,
            step_in_backward: false,
            int8_state: false,
            clips: false,
            offload_activations: false,
            offload_optimizer: false,
            weight_dtype: Default::default(),
        };
        let sets = overrides(&setting, &setting, &["neck".to_string()], &keys);
        assert_eq!(
            sets,
            [
                "model.backbone.with_cp=[\"neck\"]",
                "model.neck.with_cp=false",
                "model.bbox_head.with_cp=false"
            ]
        );
    }
}
