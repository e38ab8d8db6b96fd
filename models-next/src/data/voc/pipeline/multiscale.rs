//! The scales a multi-scale training pipeline draws, as `memsave plan` reads them.

use super::{ImgScale, MultiScale, Pipeline, Step};

/// A training pipeline that draws several scales (multi-scale training), as `memsave plan`
/// compares a plan for its largest input with one made per step.
#[derive(Clone, Debug)]
pub struct MultiScaleTraining {
    /// The compiled pipeline.
    pub pipeline: Pipeline,
    /// Its steps, as the config writes them.
    pub steps: Vec<Step>,
    /// Where they are (`data.train.pipeline`).
    pub key: String,
}

impl MultiScaleTraining {
    /// The smallest and the largest scale it draws (`[long, short]`).
    pub fn extremes(&self) -> ([usize; 2], [usize; 2]) {
        let scales: Vec<[usize; 2]> = match &self.pipeline.multiscale {
            MultiScale::Single => vec![self.pipeline.img_scale],
            MultiScale::Range([a, b]) => vec![*a, *b],
            MultiScale::Value(scales) => scales.clone(),
        };
        let long = |s: &[usize; 2]| s[0].max(s[1]);
        let short = |s: &[usize; 2]| s[0].min(s[1]);
        let smallest = [
            scales.iter().map(long).min().unwrap_or(0),
            scales.iter().map(short).min().unwrap_or(0),
        ];
        (smallest, self.pipeline.img_scale)
    }

    /// The share of the largest scale's pixels an image drawn at `scale` has (the square of the
    /// factor `keep_ratio` resizes it by, where the largest scale's limits bind).
    pub fn share(&self, scale: [usize; 2]) -> f64 {
        let largest = self.pipeline.img_scale;
        let long = scale[0].max(scale[1]) as f64 / largest[0].max(largest[1]).max(1) as f64;
        let short = scale[0].min(scale[1]) as f64 / largest[0].min(largest[1]).max(1) as f64;
        let factor = if self.pipeline.keep_ratio {
            long.min(short)
        } else {
            (long * short).sqrt()
        };
        factor * factor
    }

    /// The `--set` line that makes the training pipeline draw `scale` only.
    pub fn single_scale_set(&self, scale: [usize; 2]) -> String {
        let steps: Vec<Step> = self
            .steps
            .iter()
            .map(|step| match step {
                Step::Resize { keep_ratio, .. } => Step::Resize {
                    img_scale: ImgScale::One(scale),
                    keep_ratio: *keep_ratio,
                    multiscale_mode: None,
                },
                other => other.clone(),
            })
            .collect();
        let value = serde_json::to_value(&steps).unwrap_or(serde_json::Value::Null);
        format!("{}={}", self.key, inline_toml(&value))
    }
}

/// A JSON value written as an inline TOML value (a `--set` line's).
fn inline_toml(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "[]".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => Value::String(s.clone()).to_string(),
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(inline_toml).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(fields) => format!(
            "{{ {} }}",
            fields
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("{k} = {}", inline_toml(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
