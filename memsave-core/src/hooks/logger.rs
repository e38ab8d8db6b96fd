use std::fs::{File, OpenOptions};
use std::io::Write;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;

use crate::memory;
use crate::train::{Hook, TrainModel, TrainState};
use crate::{Error, Result};

pub use memsave_common::train::LogConfig;
use memsave_common::train::{log::LineExtras, LogBook};

/// A log line every `interval` iterations (loss and gradient norm averaged over them, learning
/// rate, loss scale, peak memory as the device's [`memory::Meter::peak`] reads it, time since the
/// start) to `train.log` in the work directory and as a `tracing` event (target `memsave`,
/// `kind = "log"`), and the run's progress as events too (`kind = "progress"`, `iter`,
/// `max_iters`): the command line prints the lines and draws the progress bar (MMCV's
/// `TextLoggerHook`); a library user's subscriber decides.
pub struct LoggerHook {
    /// Iterations between log lines.
    pub interval: usize,
    book: LogBook,
    file: Option<File>,
    started: Option<Instant>,
    meter: Option<Box<dyn memory::Meter>>,
}

impl LoggerHook {
    /// Logs every `interval` iterations (at least 1).
    pub fn new(interval: usize) -> Self {
        LoggerHook {
            interval: interval.max(1),
            book: LogBook::new(interval),
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
        self.book.record(&state.log);
        tracing::trace!(
            target: "memsave",
            kind = "progress",
            iter = state.iter + 1,
            max_iters = state.max_iters,
            "iteration {} of {}",
            state.iter + 1,
            state.max_iters
        );
        if !self.book.due(&state.at()) {
            return Ok(());
        }
        let memory = self.meter.as_ref().map(|meter| {
            let bytes = meter.peak();
            meter.reset_peak();
            bytes
        });
        let extras = LineExtras {
            lr: state.lr,
            loss_scale: state.log.loss_scale,
            memory,
            seconds: self.started.map(|started| started.elapsed().as_secs_f64()),
        };
        let line = self.book.line(&state.at(), extras);
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
