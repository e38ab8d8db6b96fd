//! `memsave plan CONFIG --budget SIZE`: where a config's memory goes, what each checkpointable
//! segment keeps and costs, and the cheapest combination of strategies that fits the budget;
//! with `--verify`, that combination measured beside the unplanned run.
//!
//! Every figure comes from steps measured in processes of their own (`memsave plan-worker`):
//! the config without checkpointing (its breakdown and peak), the config with every segment
//! checkpointed (the planner's profile), and, to predict the other strategies from measurements,
//! the same with mixed precision and with half the batch.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use memsave::config::Config;
use memsave::memory::human;
use memsave::planner::advise::{self, Candidate, Measured, Setting};
use memsave::planner::{Budget, Profile, SegmentProfile};
use memsave::{Error, Result};
use serde::Serialize;

use super::train::{Job, Measurement, TrainArgs};
use super::Device;

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The config file.
    config: PathBuf,
    /// What a step must fit in: bytes (`3GiB`, `512MiB`, `2.5GB`) or a share of the peak
    /// without checkpointing (`60%`).
    #[arg(long)]
    budget: String,
    /// Override a config key, as TOML: `--set data.samples_per_gpu=4`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Run the chosen plan and print its measured peak and time beside the prediction.
    #[arg(long)]
    verify: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Consider strategies that change the arithmetic beyond rounding (8-bit optimizer state),
    /// measured too; also `[memory] allow_approximate = true` in the config.
    #[arg(long)]
    allow_approximate: bool,
    /// Measured steps per run (after one warm-up step).
    #[arg(long, default_value_t = 2)]
    iters: usize,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Data-parallel peers the run will have: the breakdown adds each peer's share of the
    /// optimizer state (and, at stage 2, of the gradients) under `optimizer_config.zero_stage`.
    /// The measuring runs and the candidates are one process holding all of it.
    #[arg(long, default_value_t = 1)]
    devices: usize,
}

/// `memsave plan-worker`: one measuring run (started by `memsave plan`).
#[derive(clap::Args, Debug)]
pub struct PlanWorkerArgs {
    /// The config file.
    config: PathBuf,
    /// Config overrides.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Where to run.
    #[arg(long, value_enum)]
    device: Device,
    /// Warm-up steps.
    #[arg(long)]
    warmup: usize,
    /// Measured steps.
    #[arg(long)]
    iters: usize,
    /// Profile with every segment checkpointed.
    #[arg(long)]
    checkpoint_all: bool,
}

pub fn worker(args: PlanWorkerArgs) -> Result<()> {
    let train = TrainArgs {
        config: args.config,
        work_dir: None,
        resume: None,
        set: args.set,
        device: args.device,
        dist: Default::default(),
    };
    let job = Job::Measure {
        warmup: args.warmup,
        iters: args.iters,
        checkpoint_all: args.checkpoint_all,
    };
    super::worker::serve(|| super::train::run_job(&train, &job))
}

/// The breakdown of a measured step, bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Breakdown {
    pub parameters: u64,
    /// Gradient bytes live at the peak.
    pub gradients: u64,
    /// Gradient bytes live when backward ended (all of them).
    pub gradients_at_backward_end: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub other: u64,
    pub peak: u64,
    pub step_seconds: f64,
}

/// One data-parallel peer's share of the unplanned breakdown (`--devices N` above 1): ZeRO
/// stage 1 holds 1/N of the optimizer state, stage 2 also 1/N of the gradients; the rest is
/// every peer's. Estimated from the measured parts, at the moment of the measured peak.
#[derive(Clone, Debug, Serialize)]
pub struct PerPeer {
    pub peers: usize,
    pub zero_stage: u8,
    pub gradients: u64,
    pub gradients_at_backward_end: u64,
    pub optimizer_state: u64,
    pub peak: u64,
}

impl PerPeer {
    fn of(breakdown: &Breakdown, peers: usize, stage: memsave::parallel::ZeroStage) -> Self {
        use memsave::parallel::ZeroStage;
        let share = |bytes: u64, sharded: bool| {
            if sharded {
                bytes.div_ceil(peers.max(1) as u64)
            } else {
                bytes
            }
        };
        let state_sharded = stage >= ZeroStage::OptimizerState;
        let grads_sharded = stage >= ZeroStage::Gradients;
        let optimizer_state = share(breakdown.optimizer_state, state_sharded);
        let gradients = share(breakdown.gradients, grads_sharded);
        let peak = breakdown.peak
            - (breakdown.optimizer_state - optimizer_state)
            - (breakdown.gradients - gradients);
        PerPeer {
            peers,
            zero_stage: stage.number(),
            gradients,
            gradients_at_backward_end: share(breakdown.gradients_at_backward_end, grads_sharded),
            optimizer_state,
            peak,
        }
    }
}

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
    pub nothing_needed: bool,
    pub segments: Vec<SegmentProfile>,
    pub floor: u64,
    pub planning_ms: f64,
    pub advice_ms: f64,
    pub candidates: Vec<Candidate>,
    pub chosen: Option<Candidate>,
    pub verify: Option<Verified>,
}

/// Runs one measuring process.
fn run_worker(
    args: &PlanArgs,
    (what, extra): (&str, &[String]),
    iters: usize,
    checkpoint_all: bool,
) -> Result<Measurement> {
    let exe = std::env::current_exe().map_err(|source| Error::Io {
        path: PathBuf::from("memsave"),
        source,
    })?;
    let mut command = Command::new(exe);
    command.arg("plan-worker").arg(&args.config);
    for set in args.set.iter().chain(extra) {
        command.arg("--set").arg(set);
    }
    let device = args.device.as_arg();
    command
        .args(["--device", device, "--warmup", "1", "--iters"])
        .arg(iters.to_string());
    if checkpoint_all {
        command.arg("--checkpoint-all");
    }
    let worker = super::worker::spawn::<Measurement>("memsave plan-worker", command)?;
    worker.finish()?.result.map_err(|message| {
        Error::Data(format!(
            "memsave plan could not measure {what} ({}): {}",
            args.config.display(),
            message.trim_start_matches("data: ")
        ))
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The median time of an optimizer step: the measured micro-batches' times summed a group at a
/// time (the measured iterations are whole groups of `cumulative`).
fn step_seconds<'a>(
    measurements: impl IntoIterator<Item = &'a Measurement>,
    cumulative: usize,
) -> f64 {
    let groups: Vec<f64> = measurements
        .into_iter()
        .flat_map(|m| {
            m.steps
                .chunks(cumulative.max(1))
                .map(|group| group.iter().map(|s| s.0).sum::<f64>())
                .collect::<Vec<_>>()
        })
        .collect();
    median(groups)
}

fn peak_of(measurement: &Measurement) -> u64 {
    let steps = measurement.steps.iter().map(|s| s.1).max().unwrap_or(0);
    let profiled = measurement
        .profile
        .windows
        .iter()
        .map(|w| w.peak)
        .max()
        .unwrap_or(0);
    steps.max(profiled)
}

fn breakdown(measurement: &Measurement, cumulative: usize) -> Breakdown {
    let profile: &Profile = &measurement.profile;
    let optimizer_state =
        (measurement.trainable as f64 * measurement.optimizer_state_per_weight) as u64;
    let peak = peak_of(measurement);
    let window = profile.windows.iter().max_by_key(|w| w.peak);
    let (window_peak, gradients) = window.map_or((peak, 0), |w| (w.peak, w.gradients));
    Breakdown {
        parameters: measurement.parameters,
        gradients,
        gradients_at_backward_end: profile.gradients,
        optimizer_state,
        activations: window_peak.saturating_sub(profile.resident + gradients),
        other: profile
            .resident
            .saturating_sub(measurement.parameters + optimizer_state),
        peak,
        step_seconds: step_seconds([measurement], cumulative),
    }
}

pub fn plan(args: PlanArgs) -> Result<()> {
    let budget = Budget::parse(&args.budget, "--budget")?;
    if args.iters == 0 {
        return Err(Error::invalid("--iters", "at least one step is measured"));
    }
    let batch = memsave::models::registry::batch_size(&args.config, &args.set)?;
    // The model's own settings, where its registry entry says they are.
    let keys = memsave::models::registry::entry(&args.config, &args.set)?.keys;
    if args.devices == 0 {
        return Err(Error::invalid("--devices", "at least one peer"));
    }
    let (setting, allow_approximate, zero): (Setting, bool, memsave::parallel::ZeroStage) = {
        let config =
            Config::<memsave::models::config::ModelKind, memsave::models::config::AnyData>::load(
                &args.config,
                &args.set,
            )?;
        (
            config.planner_setting(batch),
            args.allow_approximate || config.memory.allow_approximate,
            config.optimizer_config.zero()?,
        )
    };
    let say = |line: &str| {
        if !args.json {
            eprintln!("{line}");
        }
    };
    let unplanned_sets = vec![format!("{}=false", keys.with_cp)];
    say("memsave plan: measuring the config without checkpointing ...");
    let unplanned = run_worker(
        &args,
        ("the config without checkpointing", &unplanned_sets),
        args.iters,
        false,
    )?;
    let unplanned_breakdown = breakdown(&unplanned, setting.cumulative);
    let budget_bytes = budget.bytes(unplanned_breakdown.peak);
    let mut report = PlanReport {
        config: args.config.clone(),
        budget: budget.to_string(),
        budget_bytes,
        unplanned: unplanned_breakdown.clone(),
        per_peer: (args.devices > 1).then(|| PerPeer::of(&unplanned_breakdown, args.devices, zero)),
        nothing_needed: budget_bytes >= unplanned_breakdown.peak,
        segments: Vec::new(),
        floor: 0,
        planning_ms: 0.0,
        advice_ms: 0.0,
        candidates: Vec::new(),
        chosen: None,
        verify: None,
    };
    if !report.nothing_needed {
        say("memsave plan: profiling with every segment checkpointed ...");
        let base = run_worker(
            &args,
            ("the config with every segment checkpointed", &[]),
            0,
            true,
        )?;
        let mut measured = vec![Measured {
            setting,
            profile: base.profile.clone(),
        }];
        if !setting.fp16 {
            say("memsave plan: profiling under mixed precision ...");
            let fp16 = run_worker(
                &args,
                (
                    "the config under mixed precision",
                    &["fp16.loss_scale=\"dynamic\"".to_string()],
                ),
                0,
                true,
            )?;
            measured.push(Measured {
                setting: Setting {
                    fp16: true,
                    ..setting
                },
                profile: fp16.profile,
            });
        }
        if !setting.step_in_backward {
            say("memsave plan: profiling the optimizer's step in backward ...");
            let sets = vec!["optimizer_config.step_in_backward=true".to_string()];
            let measurement = run_worker(
                &args,
                ("the config with the step in backward", &sets),
                0,
                true,
            )?;
            measured.push(Measured {
                setting: Setting {
                    step_in_backward: true,
                    ..setting
                },
                profile: measurement.profile,
            });
            if !setting.fp16 {
                say("memsave plan: profiling the step in backward under mixed precision ...");
                let sets = vec![
                    "optimizer_config.step_in_backward=true".to_string(),
                    "fp16.loss_scale=\"dynamic\"".to_string(),
                ];
                let measurement = run_worker(
                    &args,
                    (
                        "the config with the step in backward under mixed precision",
                        &sets,
                    ),
                    0,
                    true,
                )?;
                measured.push(Measured {
                    setting: Setting {
                        step_in_backward: true,
                        fp16: true,
                        ..setting
                    },
                    profile: measurement.profile,
                });
            }
        }
        if allow_approximate && !setting.int8_state {
            say("memsave plan: profiling 8-bit optimizer state ...");
            let sets = vec!["optimizer.state_dtype=\"int8\"".to_string()];
            let measurement = run_worker(&args, ("the config with 8-bit state", &sets), 0, true)?;
            measured.push(Measured {
                setting: Setting {
                    int8_state: true,
                    ..setting
                },
                profile: measurement.profile,
            });
        }
        if setting.micro_batch >= 2 && setting.micro_batch % 2 == 0 {
            say("memsave plan: profiling half the batch ...");
            let half = setting.micro_batch / 2;
            let sets = vec![format!("{}={half}", keys.batch)];
            let measurement = run_worker(&args, ("the config at half the batch", &sets), 0, true)?;
            measured.push(Measured {
                setting: Setting {
                    micro_batch: half,
                    ..setting
                },
                profile: measurement.profile,
            });
        }
        // The search itself, at a budget it can meet (below the floor it stops at once).
        let started = Instant::now();
        let _ = memsave::planner::plan(&base.profile, budget_bytes.max(base.profile.floor()));
        report.planning_ms = started.elapsed().as_secs_f64() * 1e3;
        report.segments = base.profile.segments.clone();
        report.floor = base.profile.floor();
        let started = Instant::now();
        report.candidates =
            advise::advise(&setting, &measured, budget_bytes, &keys, allow_approximate);
        report.advice_ms = started.elapsed().as_secs_f64() * 1e3;
        report.chosen = report.candidates.first().filter(|c| c.fits).cloned();
    }
    if args.verify {
        let sets = match &report.chosen {
            Some(chosen) => chosen.sets.clone(),
            None if report.nothing_needed => unplanned_sets.clone(),
            None => {
                return Err(Error::invalid(
                    "--budget",
                    format!(
                        "nothing fits {} ({}): there is no plan to verify",
                        human(budget_bytes),
                        args.budget
                    ),
                ))
            }
        };
        let cumulative = report.chosen.as_ref().map_or(1, |c| c.setting.cumulative);
        // Interleaved with the unplanned run, for the time ratio: planned, unplanned, planned.
        say("memsave plan: verifying the plan (planned, unplanned, planned) ...");
        let first = run_worker(&args, ("the plan", &sets), args.iters, false)?;
        let again = run_worker(
            &args,
            ("the config without checkpointing", &unplanned_sets),
            args.iters,
            false,
        )?;
        let second = run_worker(&args, ("the plan", &sets), args.iters, false)?;
        let planned_seconds = step_seconds([&first, &second], cumulative);
        let unplanned_seconds = step_seconds([&unplanned, &again], setting.cumulative);
        let measured_peak = peak_of(&first).max(peak_of(&second));
        let unplanned_peak = report.unplanned.peak.max(peak_of(&again));
        report.verify = Some(Verified {
            measured_peak,
            measured_seconds: planned_seconds,
            unplanned_seconds,
            memory_ratio: measured_peak as f64 / unplanned_peak as f64,
            time_ratio: planned_seconds / unplanned_seconds,
        });
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Error::Data(e.to_string()))?
        );
    } else {
        print_report(&report, &setting);
    }
    if report.chosen.is_none() && !report.nothing_needed {
        // The report is printed; the exit code says, for scripts, that nothing fits.
        return Err(Error::invalid(
            "--budget",
            format!(
                "nothing memsave can switch on fits {} ({}); checkpointing every segment \
                 needs {}",
                human(budget_bytes),
                args.budget,
                human(report.floor)
            ),
        ));
    }
    if let Some(verified) = report
        .verify
        .as_ref()
        .filter(|v| v.measured_peak > budget_bytes)
    {
        // The report is printed; the plan was measured over the budget: say so, and by how
        // much, and fail, so that no script takes it for a plan that fits.
        let predicted = report
            .chosen
            .as_ref()
            .map_or(report.unplanned.peak, |c| c.peak);
        return Err(Error::invalid(
            "--budget",
            format!(
                "the plan was measured at {}, over the budget of {} ({}) by {:.1}% (predicted \
                 {}, {:.1}% low); a budget {:.1}% lower plans for what was measured",
                human(verified.measured_peak),
                human(budget_bytes),
                args.budget,
                (verified.measured_peak as f64 / budget_bytes as f64 - 1.0) * 100.0,
                human(predicted),
                (1.0 - predicted as f64 / verified.measured_peak as f64) * 100.0,
                (1.0 - predicted as f64 / verified.measured_peak as f64) * 100.0,
            ),
        ));
    }
    Ok(())
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
}

fn print_report(report: &PlanReport, setting: &Setting) {
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
        println!(
            "  {:<62} {:>10} {:>9} {:>5}",
            "strategies", "peak MiB", "step s", "fits"
        );
        for c in &report.candidates {
            println!(
                "  {:<62} {:>10} {:>9.3} {:>5}{}",
                c.label,
                mib(c.peak),
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
                    "\nchosen: {}: predicted peak {} MiB, step {:.3} s{}",
                    c.label,
                    mib(c.peak),
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
}
