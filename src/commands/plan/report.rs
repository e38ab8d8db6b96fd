//! The report of `memsave plan`: what it holds and its printed tables.

use std::path::PathBuf;

use memsave::memory::human;
use memsave::planner::advise::{Candidate, Setting, Staging};
use memsave::planner::SegmentProfile;
use serde::Serialize;

use super::breakdown::Breakdown;
use super::devices::PerPeer;

/// What `--verify` measured.
#[derive(Clone, Debug, Serialize)]
pub struct Verified {
    pub measured_peak: u64,
    pub measured_seconds: f64,
    pub unplanned_seconds: f64,
    pub memory_ratio: f64,
    pub time_ratio: f64,
}

/// Everything `memsave plan` says.
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    pub config: PathBuf,
    pub budget: String,
    pub budget_bytes: u64,
    pub unplanned: Breakdown,
    /// One peer's share of it, with `--devices` above 1.
    pub per_peer: Option<PerPeer>,
    /// On a device: the host budget and the link offload is planned with.
    pub staging: Option<Staging>,
    pub nothing_needed: bool,
    pub segments: Vec<SegmentProfile>,
    pub floor: u64,
    pub planning_ms: f64,
    pub advice_ms: f64,
    pub candidates: Vec<Candidate>,
    pub chosen: Option<Candidate>,
    pub verify: Option<Verified>,
    /// A multi-scale config: a static plan for its largest input against `"dynamic"`.
    pub multiscale: Option<memsave::planner::dynamic::MultiScaleComparison>,
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
}

pub(super) fn print_report(report: &PlanReport, setting: &Setting) {
    let b = &report.unplanned;
    println!(
        "{}: batch {} ({} x {}), {}, {}",
        report.config.display(),
        setting.batch(),
        setting.micro_batch,
        setting.cumulative,
        if setting.fp16 {
            "mixed precision"
        } else {
            "fp32"
        },
        if setting.adam { "Adam(W)" } else { "SGD" }
    );
    if setting.step_in_backward || setting.int8_state {
        println!(
            "  ({}{})",
            if setting.step_in_backward {
                "the optimizer steps in backward; "
            } else {
                ""
            },
            if setting.int8_state {
                "8-bit optimizer state"
            } else {
                ""
            }
        );
    }
    println!("\nwithout checkpointing (measured; live at the peak):");
    for (name, bytes) in [
        ("parameters", b.parameters),
        ("gradients", b.gradients),
        ("optimizer state", b.optimizer_state),
        ("activations", b.activations),
        ("other", b.other),
        ("peak", b.peak),
    ] {
        println!("  {name:<16} {:>10} MiB", mib(bytes));
    }
    println!(
        "  (gradients when backward ends: {} MiB; other: the data, the runtime)",
        mib(b.gradients_at_backward_end)
    );
    println!("  {:<16} {:>10.3} s", "step", b.step_seconds);
    if let Some(peer) = &report.per_peer {
        println!(
            "\nper peer of {} (optimizer_config.zero_stage = {}; estimated from the parts \
             above, at the same moment):",
            peer.peers, peer.zero_stage
        );
        let of = |mine: u64, whole: u64| {
            if mine == whole {
                String::new()
            } else {
                format!("  (1/{} of {})", peer.peers, mib(whole))
            }
        };
        let alone = |mine: u64, whole: u64| {
            if mine == whole {
                String::new()
            } else {
                format!("  ({} in one process)", mib(whole))
            }
        };
        for (name, mine, whole) in [
            ("parameters", b.parameters, b.parameters),
            ("gradients", peer.gradients, b.gradients),
            ("optimizer state", peer.optimizer_state, b.optimizer_state),
            ("activations", b.activations, b.activations),
            ("other", b.other, b.other),
        ] {
            println!("  {name:<16} {:>10} MiB{}", mib(mine), of(mine, whole));
        }
        println!(
            "  {:<16} {:>10} MiB{}",
            "peak",
            mib(peer.peak),
            alone(peer.peak, b.peak)
        );
        println!(
            "  (gradients when backward ends: {} MiB{})",
            mib(peer.gradients_at_backward_end),
            of(peer.gradients_at_backward_end, b.gradients_at_backward_end)
        );
        if peer.zero_stage == 0 {
            println!("  (zero_stage = 0: every peer holds all of it; set 1 or 2 to shard it)");
        }
    }
    println!(
        "\nbudget: {} = {} bytes ({} MiB)",
        report.budget,
        report.budget_bytes,
        mib(report.budget_bytes)
    );
    if report.nothing_needed {
        println!(
            "nothing is needed: the config as it stands peaks at {} ({} bytes), within the budget",
            human(b.peak),
            b.peak
        );
    } else {
        println!(
            "\nsegments (measured, every one checkpointed): {}",
            report.segments.len()
        );
        println!(
            "  {:<28} {:<12} {:>10} {:>12} {:>13}",
            "segment", "type", "kept MiB", "forward ms", "recompute ms"
        );
        for s in &report.segments {
            println!(
                "  {:<28} {:<12} {:>10} {:>12.2} {:>13.2}",
                s.path,
                s.kind,
                mib(s.kept_bytes),
                s.forward_seconds * 1e3,
                s.recompute_seconds * 1e3
            );
        }
        println!(
            "  every one checkpointed: peak {} MiB (the floor of checkpointing)",
            mib(report.floor)
        );
        println!(
            "\ncandidates (predicted; best first; planning the checkpoint set took {:.2} ms, \
             all {} candidates {:.2} ms):",
            report.planning_ms,
            report.candidates.len(),
            report.advice_ms
        );
        if let Some(staging) = &report.staging {
            println!(
                "  (CPU staging: host budget {} MiB; link {:.2} GiB/s, {})",
                mib(staging.host_budget),
                staging.link_bytes_per_second / (1u64 << 30) as f64,
                staging.link_source
            );
        }
        println!(
            "  {:<62} {:>10} {:>9} {:>9} {:>5}",
            "strategies", "peak MiB", "host MiB", "step s", "fits"
        );
        for c in &report.candidates {
            println!(
                "  {:<62} {:>10} {:>9} {:>9.3} {:>5}{}",
                c.label,
                mib(c.peak),
                mib(c.host_bytes),
                c.seconds,
                if c.fits { "yes" } else { "no" },
                c.changes_training
                    .as_ref()
                    .map(|w| format!("  ({w})"))
                    .unwrap_or_default()
            );
        }
        match &report.chosen {
            Some(c) => {
                println!(
                    "\nchosen: {}: predicted peak {} MiB{}, step {:.3} s{}",
                    c.label,
                    mib(c.peak),
                    if c.host_bytes > 0 {
                        format!(" (host {} MiB)", mib(c.host_bytes))
                    } else {
                        String::new()
                    },
                    c.seconds,
                    if c.exact { "" } else { " (greedy search)" }
                );
                if let Some(words) = &c.changes_training {
                    println!("  note: {words}");
                }
                println!("  --set {}", c.sets.join(" --set "));
            }
            None => println!(
                "\nnothing memsave can switch on fits {}: a larger budget or device is needed",
                human(report.budget_bytes)
            ),
        }
    }
    if let Some(v) = &report.verify {
        let predicted = report.chosen.as_ref().map_or(b.peak, |c| c.peak);
        println!(
            "\nverified: measured peak {} MiB, step {:.3} s (unplanned {:.3} s)",
            mib(v.measured_peak),
            v.measured_seconds,
            v.unplanned_seconds
        );
        println!(
            "plan: budget={} predicted={} measured={} memory_ratio={:.3} time_ratio={:.3}",
            report.budget_bytes, predicted, v.measured_peak, v.memory_ratio, v.time_ratio
        );
    }
    if let Some(m) = &report.multiscale {
        println!(
            "\nmulti-scale training: {} sizes drawn as the pipeline draws them (the smallest {:.2} \
             of the largest's pixels), predicted from profiles at the smallest and the largest \
             scale, budget {}:",
            m.draws,
            m.smallest_ratio,
            human(m.budget)
        );
        let line = |label: &str, o: &memsave::planner::dynamic::OverSizes| {
            println!(
                "  {label:<44} mean step {:.3} s, highest peak {}",
                o.mean_seconds,
                human(o.max_peak)
            );
        };
        match &m.static_plan {
            Some(o) => line(
                &format!(
                    "static plan for the largest ({} of {} checkpointed)",
                    m.static_checkpointed.0, m.static_checkpointed.1
                ),
                o,
            ),
            None => println!("  static plan for the largest: none fits the budget there"),
        }
        line("with_cp = \"dynamic\" (each size its own plan)", &m.dynamic);
        line("every segment checkpointed", &m.all_checkpointed);
    }
}
