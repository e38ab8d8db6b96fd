use std::fs::{File, OpenOptions};
use std::io::Write;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use smart_default::SmartDefault;

use crate::memory;
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

/// How often to log (MMCV's `log_config`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Iterations between log lines.
    #[default(50)]
    pub interval: usize,
}

/// A log line every `interval` iterations (loss and gradient norm averaged over them, learning
/// rate, loss scale, peak memory as the device's [`memory::Meter::peak`] reads it, time since the
/// start) to `train.log` in the work directory and as a `tracing` event (target `memsave`,
/// `kind = "log"`), and the run's progress as events too (`kind = "progress"`, `iter`,
/// `max_iters`): the command line prints the lines and draws the progress bar (MMCV's
/// `TextLoggerHook`); a library user's subscriber decides.
pub struct LoggerHook {
    /// Iterations between log lines.
    pub interval: usize,
    losses: Vec<f64>,
    /// The global gradient norms of the steps since the last line (averaged in it).
    grad_norms: Vec<f64>,
    /// Sums and counts of the loss's named parts since the last line, in first-seen order.
    parts: Vec<(&'static str, f64, usize)>,
    /// With 16-bit weights: the shares of updates that left their weight unchanged, per step
    /// since the last line.
    unchanged: Vec<f64>,
    file: Option<File>,
    started: Option<Instant>,
    meter: Option<Box<dyn memory::Meter>>,
}

impl LoggerHook {
    /// Logs every `interval` iterations (at least 1).
    pub fn new(interval: usize) -> Self {
        LoggerHook {
            interval: interval.max(1),
            losses: Vec::new(),
            grad_norms: Vec::new(),
            parts: Vec::new(),
            unchanged: Vec::new(),
            file: None,
            started: None,
            meter: None,
        }
    }

    fn emit(&mut self, line: &str) {
        tracing::info!(target: "memsave", kind = "log", "{line}");
        if let Some(file) = &mut self.file {
            let _ = writeln!(file, "{line}");
        }
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>> Hook<B, M> for LoggerHook {
    fn name(&self) -> &'static str {
        "logger"
    }

    fn before_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if !state.is_main() {
            // Rank 0 logs a data-parallel run.
            return Ok(());
        }
        std::fs::create_dir_all(&state.work_dir).map_err(|source| Error::Io {
            path: state.work_dir.clone(),
            source,
        })?;
        let path = state.work_dir.join("train.log");
        self.file = Some(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|source| Error::Io { path, source })?,
        );
        tracing::trace!(
            target: "memsave",
            kind = "progress",
            iter = state.iter,
            max_iters = state.max_iters,
            "iteration {} of {}",
            state.iter,
            state.max_iters
        );
        self.started = Some(Instant::now());
        self.meter = memory::meter_for(&state.device);
        if let Some(meter) = &self.meter {
            meter.reset_peak();
        }
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if !state.is_main() {
            // Rank 0 logs a data-parallel run.
            return Ok(());
        }
        if let Some(loss) = state.log.loss {
            self.losses.push(loss);
        }
        if let Some(norm) = state.log.grad_norm {
            self.grad_norms.push(norm);
        }
        if let Some(share) = state.log.weights_unchanged {
            self.unchanged.push(share);
        }
        for &(name, value) in &state.log.parts {
            match self.parts.iter_mut().find(|(n, _, _)| *n == name) {
                Some((_, sum, count)) => {
                    *sum += value;
                    *count += 1;
                }
                None => self.parts.push((name, value, 1)),
            }
        }
        tracing::trace!(
            target: "memsave",
            kind = "progress",
            iter = state.iter + 1,
            max_iters = state.max_iters,
            "iteration {} of {}",
            state.iter + 1,
            state.max_iters
        );
        if !(state.every_n_iters(self.interval) || state.is_last_iter()) {
            return Ok(());
        }
        let position = if state.by_epoch {
            format!(
                "Epoch [{}][{}/{}]",
                state.epoch + 1,
                state.inner_iter + 1,
                state.iters_per_epoch
            )
        } else {
            format!("Iter [{}/{}]", state.iter + 1, state.max_iters)
        };
        let mut line = format!("{position}  lr: {:.3e}", state.lr);
        for (name, sum, count) in self.parts.drain(..) {
            line.push_str(&format!("  {name}: {:.4}", sum / count as f64 + 0.0));
        }
        if !self.losses.is_empty() {
            // `+ 0.0` turns a -0.0 into 0.0 for printing.
            let mean = self.losses.iter().sum::<f64>() / self.losses.len() as f64 + 0.0;
            line.push_str(&format!("  loss: {mean:.4}"));
            self.losses.clear();
        }
        if !self.grad_norms.is_empty() {
            // Averaged over the interval's steps, as the loss (MMCV's `LogBuffer`).
            let mean = self.grad_norms.iter().sum::<f64>() / self.grad_norms.len() as f64;
            line.push_str(&format!("  grad_norm: {mean:.4}"));
            self.grad_norms.clear();
        }
        if let Some(scale) = state.log.loss_scale {
            line.push_str(&format!("  loss_scale: {scale}"));
        }
        if !self.unchanged.is_empty() {
            // 16-bit weights: the share of non-zero updates their rounding left unchanged.
            let mean = self.unchanged.iter().sum::<f64>() / self.unchanged.len() as f64;
            line.push_str(&format!("  unchanged: {:.2}%", 100.0 * mean));
            self.unchanged.clear();
        }
        if let Some(meter) = &self.meter {
            let bytes = meter.peak();
            line.push_str(&format!("  memory: {:.1} MiB", memory::mib(bytes as usize)));
            meter.reset_peak();
        }
        if let Some(started) = self.started {
            line.push_str(&format!("  time: {:.1} s", started.elapsed().as_secs_f64()));
        }
        self.emit(&line);
        Ok(())
    }

    fn after_run(&mut self, state: &mut TrainState<B, M>) -> Result<()> {
        if !state.is_main() {
            // Rank 0 logs a data-parallel run.
            return Ok(());
        }
        tracing::trace!(
            target: "memsave",
            kind = "progress",
            iter = state.max_iters,
            max_iters = state.max_iters,
            done = true,
            "the run ended"
        );
        for warning in state.warnings().to_vec() {
            if let Some(file) = &mut self.file {
                let _ = writeln!(file, "warning: {warning}");
            }
        }
        Ok(())
    }
}
