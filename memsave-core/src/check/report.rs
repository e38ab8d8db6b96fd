//! What the check found: each pass, each segment, and the table they print as.

use std::fmt;

use crate::memory;

/// One pass: its loss, its gradients and its memory.
#[derive(Clone, Debug, PartialEq)]
pub struct PassReport {
    /// `fp32` or the half precision, and `plain` or `checkpointed`.
    pub name: String,
    /// The loss, as fp32.
    pub loss: f64,
    /// The step's peak above its start (forward and backward), where a meter can be read.
    pub peak_bytes: Option<u64>,
    /// Bytes live after the forward beyond the start: what was kept for backward.
    pub kept_bytes: Option<u64>,
    /// The worst relative gradient difference against the reference pass (0 for the
    /// reference): over parameters, `max |a - b| / max |b|`.
    pub difference: f64,
    /// The parameter where it is, by module path (`backbone.layer1.0.conv1.weight`).
    pub worst_parameter: Option<String>,
    /// The pass it was compared with.
    pub against: String,
}

/// One `#[with_cp]` segment.
#[derive(Clone, Debug, PartialEq)]
pub struct SegmentReport {
    /// Its module path.
    pub path: String,
    /// Its type (`Bottleneck`).
    pub type_name: String,
    /// Whether it ran checkpointed (and was recomputed in backward). A segment whose input is
    /// not in the autodiff graph (MMCV's guard: the network's first layer), or that a tracked
    /// tensor enters other than as its input or a parameter (one captured by the closure, or
    /// held in a bare `Tensor` field), runs plainly, exact but saving nothing.
    pub checkpointed: bool,
    /// Why it ran plainly, when it did.
    pub why_plain: Option<String>,
    /// Times its forward was recomputed in the checkpointed fp32 pass's backward.
    pub recomputed: usize,
    /// Bytes its forward left live without checkpointing (what it keeps for backward plus its
    /// output), where a meter can be read.
    pub kept_plain: Option<u64>,
    /// The same with checkpointing (its output only).
    pub kept_checkpointed: Option<u64>,
}

impl SegmentReport {
    /// Bytes checkpointing saved in this segment's forward.
    pub fn saved(&self) -> Option<i64> {
        Some(self.kept_plain? as i64 - self.kept_checkpointed? as i64)
    }
}

/// What [`check_model`](super::check_model) found.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckReport {
    /// The passes: fp32 plain (the reference), fp32 checkpointed, then the half ones.
    pub passes: Vec<PassReport>,
    /// The segments, in field order.
    pub segments: Vec<SegmentReport>,
    /// What measured the memory, or why nothing did.
    pub meter: String,
}

impl CheckReport {
    /// The worst gradient difference checkpointing made, in fp32 or in half (each against
    /// the same precision without checkpointing); half against fp32 is not counted.
    pub fn worst_difference(&self) -> f64 {
        self.passes
            .iter()
            .filter(|pass| pass.name.ends_with("checkpointed"))
            .map(|pass| pass.difference)
            .fold(0.0, |worst, d| {
                if d.is_nan() || worst.is_nan() {
                    f64::NAN
                } else {
                    worst.max(d)
                }
            })
    }

    /// The pass named `name` (`fp32 checkpointed`, `f16 plain`, ...).
    pub fn pass(&self, name: &str) -> Option<&PassReport> {
        self.passes.iter().find(|pass| pass.name == name)
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = |b: Option<u64>| b.map_or("-".to_string(), memory::human);
        writeln!(f, "memsave check (memory: {})", self.meter)?;
        writeln!(
            f,
            "  {:<18} {:>12} {:>11} {:>11} {:>11}  against",
            "pass", "loss", "peak", "kept", "grad diff"
        )?;
        for pass in &self.passes {
            write!(
                f,
                "  {:<18} {:>12.6} {:>11} {:>11} {:>11.3e}",
                pass.name,
                pass.loss,
                bytes(pass.peak_bytes),
                bytes(pass.kept_bytes),
                pass.difference
            )?;
            if !pass.against.is_empty() {
                write!(f, "  {}", pass.against)?;
                if let Some(worst) = &pass.worst_parameter {
                    if pass.difference > 0.0 {
                        write!(f, " (worst: {worst})")?;
                    }
                }
            }
            writeln!(f)?;
        }
        if self.segments.is_empty() {
            writeln!(
                f,
                "  no checkpointed segment: mark the blocks to recompute with #[with_cp] (a \
                 field of the model, or a method of a #[memsave::model] block)"
            )?;
        }
        for segment in &self.segments {
            let saved = segment
                .saved()
                .map_or("-".to_string(), |s| memory::human(s.max(0) as u64));
            if let Some(why) = &segment.why_plain {
                writeln!(
                    f,
                    "  segment {} ({}): ran plainly, saving nothing: {why}",
                    segment.path, segment.type_name
                )?;
                continue;
            }
            writeln!(
                f,
                "  segment {} ({}): recomputed {}x, kept {} -> {}, saved {}",
                segment.path,
                segment.type_name,
                segment.recomputed,
                bytes(segment.kept_plain),
                bytes(segment.kept_checkpointed),
                saved
            )?;
        }
        Ok(())
    }
}
