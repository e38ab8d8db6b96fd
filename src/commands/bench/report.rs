//! `bench.json` (the schema `scripts/torch_reference.py` writes too), the Markdown tables, and
//! `--compare`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The configurations, in the table's order: the article's five, then the strategies beyond
/// MMCV's (the optimizer's step in backward, 8-bit optimizer state, `lean`: every exact
/// strategy that lowers the peak with 8-bit state, `bf16_weights`: the trainable weights in
/// bf16 as their only copy, and `lean_bf16`: both). Run when `--only` names none.
pub const CONFIGS: [&str; 10] = [
    "base",
    "amp",
    "accumulation",
    "checkpoint",
    "all",
    "step_in_backward",
    "int8_state",
    "lean",
    "bf16_weights",
    "lean_bf16",
];

/// CPU staging's configurations, run by default on a device (`--device wgpu` or `cuda`) after
/// [`CONFIGS`]: on the CPU host and device are one memory and offload saves nothing (`--only`
/// still runs them there, and each says so). `offload_activations`: every part of the detector
/// checkpointed and the segments' inputs in host memory; `offload_optimizer`: the optimizer's
/// state and fp32 masters in host memory, stepped there; `all_offload`: `all` with both.
pub const OFFLOAD_CONFIGS: [&str; 3] = ["offload_activations", "offload_optimizer", "all_offload"];

/// What one run of the benchmark measured: `bench.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// Where it ran, in words (`cpu (Flex, 2 threads)`, `NVIDIA H200 (CUDA)`).
    pub device: String,
    /// What was trained (`RetinaNet R50-FPN`), and by whom (`memsave`, `PyTorch 2.x`).
    pub model: String,
    /// `[height, width]` of every image.
    pub image_size: [usize; 2],
    /// Images per optimizer step.
    pub batch: usize,
    /// Measured optimizer steps per configuration (after the warm-up).
    pub iters: usize,
    /// The framework that ran it (`memsave 0.1.0`, `PyTorch 2.15.0`).
    #[serde(default)]
    pub framework: Option<String>,
    /// The optimizer (`SGD`, `Adam`).
    #[serde(default)]
    pub optimizer: Option<String>,
    /// One entry per configuration, in [`CONFIGS`] order.
    pub configs: Vec<ConfigResult>,
}

/// One configuration's figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfigResult {
    /// `base`, `amp`, `accumulation`, `checkpoint` or `all`.
    pub name: String,
    /// The highest peak of live bytes over the measured steps, above the live bytes at the
    /// step's start (model, optimizer state and data resident; no gradients).
    pub peak_bytes: u64,
    /// The whole step's peak: the live bytes at that peak, the resident ones included
    /// (weights, optimizer state, gradients, activations: what the device must hold;
    /// `torch.cuda.max_memory_allocated`'s figure). 0 where not measured.
    #[serde(default)]
    pub whole_step_peak_bytes: u64,
    /// The median seconds of one optimizer step (both micro-batches, under accumulation).
    pub median_iter_s: f64,
    /// The loss of the last step (the mean of its micro-batches' losses under accumulation).
    pub final_loss: f64,
    /// Where the bytes live at the peak went, by kind (bytes; together they are `total`, the
    /// live bytes at the peak, of which `baseline` were live at the step's start):
    /// `parameters` and `optimizer_state` (resident), `activations` (kept for backward, or
    /// recomputed), `gradients` (of the parameters, and in flight), `optimizer_step` (the new
    /// weights and state the step makes while the old are live), `other` (the batch, the
    /// runtime). A key is absent where the run could not measure it.
    #[serde(default)]
    pub breakdown: BTreeMap<String, u64>,
    /// Seconds of every measured step.
    #[serde(default)]
    pub iter_s: Vec<f64>,
    /// Live bytes above the step's start across the last measured step: `[seconds, bytes]`.
    #[serde(default)]
    pub timeline: Vec<(f64, u64)>,
    /// The phase at each timeline sample (`forward`, `backward`, `recompute`, `step`, ...),
    /// where known.
    #[serde(default)]
    pub timeline_phase: Vec<String>,
    /// The bytes each tag (phase and scope, `forward.layer2.0`) added from the step's start to
    /// its peak, for a closer look than the breakdown's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peak_tags: Vec<(String, i64)>,
    /// Segments recomputed in backward over the measured steps (memsave's counter; 0 without
    /// checkpointing).
    #[serde(default)]
    pub recomputations: u64,
    /// On a device: the host memory the run held at its highest during the measured steps, above
    /// what the process held before the training loop was built (the offloaded activations,
    /// the optimizer's state and masters under optimizer offload, the runtime's staging). Absent
    /// on the CPU, where host and device are one memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_peak_bytes: Option<u64>,
}

impl BenchReport {
    /// Reads a `bench.json` (memsave's or the PyTorch script's).
    pub fn read(path: &Path) -> memsave::Result<BenchReport> {
        let text = std::fs::read_to_string(path).map_err(|source| memsave::Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|error| {
            memsave::Error::Data(format!(
                "{}: not a bench.json ({error}); it needs `device`, `model`, `image_size`, \
                 `batch`, `iters` and `configs` with `name`, `peak_bytes`, `median_iter_s` \
                 and `final_loss`",
                path.display()
            ))
        })
    }

    /// The entry of configuration `name`.
    pub fn config(&self, name: &str) -> Option<&ConfigResult> {
        self.configs.iter().find(|c| c.name == name)
    }

    /// `name`'s peak over `base`'s.
    pub fn memory_ratio(&self, name: &str) -> Option<f64> {
        let base = self.config("base")?.peak_bytes as f64;
        (base > 0.0).then(|| self.config(name).map(|c| c.peak_bytes as f64 / base))?
    }

    /// `name`'s whole-step peak over `base`'s.
    pub fn whole_step_ratio(&self, name: &str) -> Option<f64> {
        let base = self.config("base")?.whole_step_peak_bytes as f64;
        (base > 0.0).then(|| {
            self.config(name)
                .filter(|c| c.whole_step_peak_bytes > 0)
                .map(|c| c.whole_step_peak_bytes as f64 / base)
        })?
    }

    /// `name`'s median step time over `base`'s.
    pub fn time_ratio(&self, name: &str) -> Option<f64> {
        let base = self.config("base")?.median_iter_s;
        (base > 0.0).then(|| self.config(name).map(|c| c.median_iter_s / base))?
    }

    /// Who ran it, for headers: the framework, else the model's words.
    pub fn who(&self) -> String {
        self.framework.clone().unwrap_or_else(|| self.model.clone())
    }
}

pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn ratio(value: Option<f64>) -> String {
    value.map_or("-".to_string(), |r| format!("{r:.2}x"))
}

fn part(config: &ConfigResult, key: &str) -> String {
    config
        .breakdown
        .get(key)
        .map_or("-".to_string(), |&b| format!("{:.1}", mib(b)))
}

/// The Markdown table of one report: memory and time, their ratios to `base`, and the
/// breakdown at the peak.
pub fn table(report: &BenchReport) -> String {
    let mut out = format!(
        "{}: {}, {} images of {}x{} per step, {} measured steps, {} on {}\n\n",
        report.who(),
        report.model,
        report.batch,
        report.image_size[1],
        report.image_size[0],
        report.iters,
        report.optimizer.as_deref().unwrap_or("SGD"),
        report.device
    );
    // The host's column where a run on a device measured it.
    let host = report.configs.iter().any(|c| c.host_peak_bytes.is_some());
    out.push_str(
        "| config | peak MiB | memory vs base | whole-step peak MiB | whole step vs base | \
         s/step | time vs base | final loss | parameters | optimizer state | activations | \
         gradients | optimizer step | other (MiB live at the peak) |",
    );
    out.push_str(if host { " host peak MiB |\n" } else { "\n" });
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    out.push_str(if host { "---|\n" } else { "\n" });
    for config in &report.configs {
        let whole = if config.whole_step_peak_bytes > 0 {
            format!("{:.1}", mib(config.whole_step_peak_bytes))
        } else {
            "-".to_string()
        };
        out.push_str(&format!(
            "| {} | {:.1} | {} | {whole} | {} | {:.2} | {} | {:.4} | {} | {} | {} | {} | {} | {} |",
            config.name,
            mib(config.peak_bytes),
            ratio(report.memory_ratio(&config.name)),
            ratio(report.whole_step_ratio(&config.name)),
            config.median_iter_s,
            ratio(report.time_ratio(&config.name)),
            config.final_loss,
            part(config, "parameters"),
            part(config, "optimizer_state"),
            part(config, "activations"),
            part(config, "gradients"),
            part(config, "optimizer_step"),
            part(config, "other"),
        ));
        if host {
            let bytes = config.host_peak_bytes;
            out.push_str(&bytes.map_or(" - |".to_string(), |b| format!(" {:.1} |", mib(b))));
        }
        out.push('\n');
    }
    out
}

/// Both reports side by side, configuration by configuration.
pub fn comparison(ours: &BenchReport, theirs: &BenchReport) -> String {
    let (a, b) = (ours.who(), theirs.who());
    let mut out = format!("{a} beside {b} ({})\n\n", theirs.device);
    out.push_str(&format!(
        "| config | {a} peak MiB | {b} peak MiB | {a} / {b} | {a} memory vs base | {b} memory vs \
         base | {a} s/step | {b} s/step | {a} time vs base | {b} time vs base |\n"
    ));
    out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for config in &ours.configs {
        let other = theirs.config(&config.name);
        let peak = other.map_or("-".to_string(), |o| format!("{:.1}", mib(o.peak_bytes)));
        let over = other
            .filter(|o| o.peak_bytes > 0)
            .map(|o| config.peak_bytes as f64 / o.peak_bytes as f64);
        let time = other.map_or("-".to_string(), |o| format!("{:.2}", o.median_iter_s));
        out.push_str(&format!(
            "| {} | {:.1} | {peak} | {} | {} | {} | {:.2} | {time} | {} | {} |\n",
            config.name,
            mib(config.peak_bytes),
            ratio(over),
            ratio(ours.memory_ratio(&config.name)),
            ratio(theirs.memory_ratio(&config.name)),
            config.median_iter_s,
            ratio(ours.time_ratio(&config.name)),
            ratio(theirs.time_ratio(&config.name)),
        ));
    }
    let differs = |what: &str, x: String, y: String| {
        (x != y).then(|| format!("note: the two runs differ in {what}: {x} here, {y} there\n"))
    };
    out.extend(differs(
        "image size",
        format!("{:?}", ours.image_size),
        format!("{:?}", theirs.image_size),
    ));
    out.extend(differs(
        "batch",
        ours.batch.to_string(),
        theirs.batch.to_string(),
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(name: &str, peak: u64, time: f64) -> ConfigResult {
        ConfigResult {
            name: name.into(),
            peak_bytes: peak,
            whole_step_peak_bytes: 0,
            median_iter_s: time,
            final_loss: 1.0,
            breakdown: BTreeMap::new(),
            iter_s: vec![time],
            timeline: Vec::new(),
            timeline_phase: Vec::new(),
            peak_tags: Vec::new(),
            recomputations: 0,
            host_peak_bytes: None,
        }
    }

    fn report(peaks: [u64; 2]) -> BenchReport {
        BenchReport {
            device: "cpu".into(),
            model: "RetinaNet".into(),
            image_size: [320, 320],
            batch: 2,
            iters: 3,
            framework: None,
            optimizer: None,
            configs: vec![config("base", peaks[0], 2.0), config("amp", peaks[1], 3.0)],
        }
    }

    #[test]
    fn ratios_are_over_base() {
        let r = report([400 << 20, 100 << 20]);
        assert_eq!(r.memory_ratio("amp"), Some(0.25));
        assert_eq!(r.time_ratio("amp"), Some(1.5));
        assert_eq!(r.memory_ratio("all"), None);
        let text = table(&r);
        assert!(
            text.contains("| amp | 100.0 | 0.25x | - | - | 3.00 | 1.50x |"),
            "{text}"
        );
    }

    #[test]
    fn comparison_divides_peaks() {
        let ours = report([400 << 20, 100 << 20]);
        let mut theirs = report([800 << 20, 400 << 20]);
        theirs.framework = Some("PyTorch".into());
        theirs.image_size = [320, 256];
        let text = comparison(&ours, &theirs);
        assert!(text.contains("| base | 400.0 | 800.0 | 0.50x |"), "{text}");
        assert!(text.contains("differ in image size"), "{text}");
    }

    #[test]
    fn minimal_json_reads() {
        let text = r#"{"device": "cpu", "model": "m", "image_size": [320, 320], "batch": 2,
            "iters": 3, "configs": [{"name": "base", "peak_bytes": 10, "median_iter_s": 1.5,
            "final_loss": 2.0, "breakdown": {"parameters": 4}}]}"#;
        let r: BenchReport = serde_json::from_str(text).unwrap();
        assert_eq!(r.configs[0].breakdown["parameters"], 4);
    }
}
