//! The log line of MMCV's `TextLoggerHook`: the loss, its parts and the gradient norm averaged
//! over the interval, the learning rate, the loss scale, the peak memory and the time. Each
//! runtime's `LoggerHook` feeds a [`LogBook`] and writes its lines.

use smart_default::SmartDefault;

use super::{At, IterLog};

/// How often to log (MMCV's `log_config`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Iterations between log lines.
    #[default(50)]
    pub interval: usize,
}

/// What the iterations since the last log line gave, and the line when one is due.
#[derive(Clone, Debug, Default)]
pub struct LogBook {
    interval: usize,
    losses: Vec<f64>,
    /// The global gradient norms of the steps since the last line (averaged in it).
    grad_norms: Vec<f64>,
    /// Sums and counts of the loss's named parts since the last line, in first-seen order.
    parts: Vec<(&'static str, f64, usize)>,
    /// With 16-bit weights: the shares of updates that left their weight unchanged, per step
    /// since the last line.
    unchanged: Vec<f64>,
}

/// What a log line reads beside the iterations' values.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LineExtras {
    /// The learning rate of the iteration.
    pub lr: f64,
    /// The loss scale, under mixed precision.
    pub loss_scale: Option<f64>,
    /// The device's peak bytes since the last line, where a meter reads them.
    pub memory: Option<u64>,
    /// Seconds since the run started.
    pub seconds: Option<f64>,
}

impl LogBook {
    /// A line every `interval` iterations (at least 1).
    pub fn new(interval: usize) -> Self {
        LogBook {
            interval: interval.max(1),
            ..Default::default()
        }
    }

    /// Iterations between lines.
    pub fn interval(&self) -> usize {
        self.interval
    }

    /// Keeps an iteration's values for the next line.
    pub fn record(&mut self, log: &IterLog) {
        if let Some(loss) = log.loss {
            self.losses.push(loss);
        }
        if let Some(norm) = log.grad_norm {
            self.grad_norms.push(norm);
        }
        if let Some(share) = log.weights_unchanged {
            self.unchanged.push(share);
        }
        for &(name, value) in &log.parts {
            match self.parts.iter_mut().find(|(n, _, _)| *n == name) {
                Some((_, sum, count)) => {
                    *sum += value;
                    *count += 1;
                }
                None => self.parts.push((name, value, 1)),
            }
        }
    }

    /// Whether a line is due after iteration `at` (every `interval`, and the last).
    pub fn due(&self, at: &At) -> bool {
        at.every_n_iters(self.interval) || at.is_last_iter()
    }

    /// The line after iteration `at`, from the values kept since the last one (which it
    /// clears).
    pub fn line(&mut self, at: &At, extras: LineExtras) -> String {
        let position = if at.by_epoch {
            format!(
                "Epoch [{}][{}/{}]",
                at.epoch + 1,
                at.inner_iter + 1,
                at.iters_per_epoch
            )
        } else {
            format!("Iter [{}/{}]", at.iter + 1, at.max_iters)
        };
        let mut line = format!("{position}  lr: {:.3e}", extras.lr);
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
        if let Some(scale) = extras.loss_scale {
            line.push_str(&format!("  loss_scale: {scale}"));
        }
        if !self.unchanged.is_empty() {
            // 16-bit weights: the share of non-zero updates their rounding left unchanged.
            let mean = self.unchanged.iter().sum::<f64>() / self.unchanged.len() as f64;
            line.push_str(&format!("  unchanged: {:.2}%", 100.0 * mean));
            self.unchanged.clear();
        }
        if let Some(bytes) = extras.memory {
            line.push_str(&format!(
                "  memory: {:.1} MiB",
                crate::memory::mib(bytes as usize)
            ));
        }
        if let Some(seconds) = extras.seconds {
            line.push_str(&format!("  time: {seconds:.1} s"));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(iter: usize) -> At {
        At {
            iter,
            epoch: iter / 4,
            inner_iter: iter % 4,
            iters_per_epoch: 4,
            max_iters: 10,
            by_epoch: true,
        }
    }

    #[test]
    fn a_line_averages_the_interval_and_clears_it() {
        let mut book = LogBook::new(2);
        for (loss, norm) in [(1.0, Some(3.0)), (2.0, None)] {
            book.record(&IterLog {
                loss: Some(loss),
                grad_norm: norm,
                parts: vec![("loss_cls", loss / 2.0)],
                ..Default::default()
            });
        }
        assert!(!book.due(&at(0)));
        assert!(book.due(&at(1)) && book.due(&at(9)));
        let line = book.line(
            &at(1),
            LineExtras {
                lr: 0.01,
                loss_scale: Some(512.0),
                memory: Some(3 << 20),
                seconds: Some(1.5),
            },
        );
        assert_eq!(
            line,
            "Epoch [1][2/4]  lr: 1.000e-2  loss_cls: 0.7500  loss: 1.5000  grad_norm: 3.0000  \
             loss_scale: 512  memory: 3.0 MiB  time: 1.5 s"
        );
        let empty = book.line(&at(3), LineExtras::default());
        assert_eq!(empty, "Epoch [1][4/4]  lr: 0.000e0");
    }
}
