//! `memsave plan CONFIG --budget SIZE`: where a config's memory goes, what each checkpointable
//! segment keeps and costs, and the cheapest combination of strategies that fits the budget;
//! with `--verify`, that combination measured beside the unplanned run.
//!
//! Every figure comes from steps measured in processes of their own (`memsave plan-worker`):
//! the config without checkpointing (its breakdown and peak), the config with every segment
//! checkpointed (the planner's profile), and, to predict the other strategies from measurements,
//! the same with mixed precision and with half the batch.

mod breakdown;
mod devices;
mod report;
mod worker;

use std::path::PathBuf;
use std::time::Instant;

use memsave::config::Config;
use memsave::config::{available_host_memory, MemorySection};
use memsave::memory::human;
use memsave::planner::advise::{self, Measured, Setting, Staging};
use memsave::planner::Budget;
use memsave::{Error, Result};

use super::Device;
use breakdown::{breakdown, peak_of, step_seconds};
use devices::PerPeer;
use report::{print_report, PlanReport, Verified};
use worker::run_worker;
pub use worker::{worker, PlanWorkerArgs};

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

pub fn plan(mut args: PlanArgs) -> Result<()> {
    let budget = Budget::parse(&args.budget, "--budget")?;
    // A multi-scale config is planned at its largest scale (the static plan a run would pin),
    // and compared with "dynamic" over the sizes it draws.
    let multi = memsave::models::registry::multiscale_training(&args.config, &args.set)?;
    if let Some(multi) = &multi {
        let (_, largest) = multi.extremes();
        if !args.json {
            eprintln!(
                "memsave plan: multi-scale training ({}): planned at its largest scale \
                 {largest:?}",
                multi.key
            );
        }
        args.set.push(multi.single_scale_set(largest));
    }
    if args.iters == 0 {
        return Err(Error::invalid("--iters", "at least one step is measured"));
    }
    let batch = memsave::models::registry::batch_size(&args.config, &args.set)?;
    // The model's own settings, where its registry entry says they are.
    let keys = memsave::models::registry::entry(&args.config, &args.set)?.keys;
    if args.devices == 0 {
        return Err(Error::invalid("--devices", "at least one peer"));
    }
    let (setting, allow_approximate, zero, memory): (
        Setting,
        bool,
        memsave::parallel::ZeroStage,
        MemorySection,
    ) = {
        let config =
            Config::<memsave::models::config::ModelKind, memsave::models::config::AnyData>::load(
                &args.config,
                &args.set,
            )?;
        (
            config.planner_setting(batch),
            args.allow_approximate || config.memory.allow_approximate,
            config.optimizer_config.zero()?,
            config.memory.clone(),
        )
    };
    // CPU staging is planned on a device with memory of its own (never on the CPU, whose
    // tensors are host memory): the host budget is read now, so that a bad one stops the plan
    // before anything is measured.
    let host_budget = match (args.device, memory.host_budget, available_host_memory()) {
        (Device::Cpu, _, _) => None,
        (_, None, None) => {
            if !args.json {
                eprintln!(
                    "memsave plan: the machine's available memory could not be read: no offload \
                     is planned (give `[memory] host_budget`, the host bytes staging may use)"
                );
            }
            None
        }
        (_, _, available) => Some(memory.host_budget_bytes(available)?),
    };
    let say = |line: &str| {
        if !args.json {
            eprintln!("{line}");
        }
    };
    let unplanned_sets: Vec<String> = std::iter::once(keys.with_cp)
        .chain(keys.also_with_cp.iter().copied())
        .map(|key| format!("{key}=false"))
        .collect();
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
        staging: None,
        nothing_needed: budget_bytes >= unplanned_breakdown.peak,
        segments: Vec::new(),
        floor: 0,
        planning_ms: 0.0,
        advice_ms: 0.0,
        candidates: Vec::new(),
        chosen: None,
        verify: None,
        multiscale: None,
    };
    // The profile with every segment checkpointed (at a multi-scale config's largest scale).
    let mut checkpointed_profile = None;
    if !report.nothing_needed {
        say("memsave plan: profiling with every segment checkpointed ...");
        let base = run_worker(
            &args,
            ("the config with every segment checkpointed", &[]),
            0,
            true,
        )?;
        checkpointed_profile = Some(base.profile.clone());
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
        if let Some(host_budget) = host_budget {
            report.staging = staging(&args, &setting, &mut measured, host_budget, &memory, &say)?;
        }
        // The search itself, at a budget it can meet (below the floor it stops at once).
        let started = Instant::now();
        let _ = memsave::planner::plan(&base.profile, budget_bytes.max(base.profile.floor()));
        report.planning_ms = started.elapsed().as_secs_f64() * 1e3;
        report.segments = base.profile.segments.clone();
        report.floor = base.profile.floor();
        let started = Instant::now();
        report.candidates = advise::advise(
            &setting,
            &measured,
            budget_bytes,
            &keys,
            allow_approximate,
            report.staging.as_ref(),
        );
        report.advice_ms = started.elapsed().as_secs_f64() * 1e3;
        report.chosen = report.candidates.first().filter(|c| c.fits).cloned();
    }
    if let Some(multi) = &multi {
        report.multiscale = Some(multiscale(
            &args,
            multi,
            checkpointed_profile,
            report.budget_bytes,
            &say,
        )?);
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
            serde_json::to_string_pretty(&report)
                .map_err(|e| Error::state("the plan's report", e))?
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

/// `memsave train` of a multi-scale config under `with_cp = "dynamic"`: before training, one
/// step at the largest scale with every segment checkpointed, measured in a worker. The least
/// there over the budget is an error now, naming it and what holds it; a share budget becomes
/// the share of that scale's peak without checkpointing, in bytes (the `--set` line returned),
/// so that it does not hang on the size the first batch draws.
pub fn dynamic_budget_at_largest(
    train: &crate::commands::train::TrainArgs,
) -> Result<Option<String>> {
    let Some(multi) = memsave::models::registry::dynamic_multiscale(&train.config, &train.set)?
    else {
        return Ok(None);
    };
    let config =
        Config::<memsave::models::config::ModelKind, memsave::models::config::AnyData>::load(
            &train.config,
            &train.set,
        )?;
    let Some(budget) = config.memory.memory_budget else {
        // The run's own check names the missing key.
        return Ok(None);
    };
    let (_, largest) = multi.extremes();
    eprintln!(
        "memsave: with_cp = \"dynamic\" on multi-scale training: one step at the largest scale \
         {largest:?}, every segment checkpointed, measured first ..."
    );
    let args = PlanArgs {
        config: train.config.clone(),
        budget: budget.to_string(),
        set: [train.set.clone(), vec![multi.single_scale_set(largest)]].concat(),
        verify: false,
        json: true,
        allow_approximate: false,
        iters: 1,
        device: train.device,
        devices: 1,
    };
    let measured = run_worker(&args, ("the config at its largest scale", &[]), 0, true)?;
    let profile = measured.profile;
    let (floor, unplanned) = (profile.floor(), profile.unplanned_peak());
    let bytes = budget.bytes(unplanned);
    if floor > bytes {
        return Err(Error::OutOfMemory {
            what: format!(
                "one step at the largest scale {largest:?} with every one of the {} segments \
                 checkpointed, the least \"dynamic\" can give,",
                profile.segments.len()
            ),
            needed: floor,
            place: format!("the memory budget `memory.memory_budget = {budget}`"),
            available: Some(bytes),
            advice: format!(
                "what holds the most there is {}. Lower the largest scale ({}'s Resize \
                 `img_scale`) or the batch, put more of the model in segments, or switch on \
                 mixed precision or 8-bit optimizer state",
                memsave::planner::dynamic::holds_most(&profile),
                multi.key
            ),
        });
    }
    eprintln!(
        "memsave: at the largest scale: {} without checkpointing, {} with every segment \
         checkpointed; the budget {budget} is {}",
        human(unplanned),
        human(floor),
        human(bytes)
    );
    Ok(Some(format!("memory.memory_budget={bytes}")))
}

/// A multi-scale config: profiles at its smallest and largest scales (every segment
/// checkpointed), and the comparison over the sizes its pipeline draws of a static plan for the
/// largest with `"dynamic"`, under `budget_bytes` (a share budget is of the largest scale's
/// peak without checkpointing, as the whole plan is).
fn multiscale(
    args: &PlanArgs,
    multi: &memsave::models::data::voc::pipeline::MultiScaleTraining,
    largest: Option<memsave::planner::Profile>,
    budget_bytes: u64,
    say: &dyn Fn(&str),
) -> Result<memsave::planner::dynamic::MultiScaleComparison> {
    let (smallest, _) = multi.extremes();
    // The plan's own runs are at the largest scale already (`args.set` says so): its profile
    // with every segment checkpointed is the largest's, where it took one.
    let large = match largest {
        Some(profile) => profile,
        None => run_worker(args, ("the config at its largest scale", &[]), 0, true)?.profile,
    };
    say(&format!(
        "memsave plan: multi-scale training: profiling at the smallest scale {smallest:?} ..."
    ));
    let small = run_worker(
        args,
        (
            "the config at its smallest scale",
            &[multi.single_scale_set(smallest)],
        ),
        0,
        true,
    )?;
    // The sizes the training draws, from a seeded stream (splitmix64).
    let mut seed = 0x9E37_79B9_7F4A_7C15_u64;
    let mut uniform = |n: usize| {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % n.max(1) as u64) as usize
    };
    let ratios: Vec<f64> = (0..200)
        .map(|_| multi.share(multi.pipeline.draw_scale(&mut uniform)))
        .collect();
    Ok(memsave::planner::dynamic::compare_multiscale(
        &large,
        Some((&small.profile, multi.share(smallest))),
        &ratios,
        budget_bytes,
    ))
}

/// On a device: profiles with activation offload, optimizer offload and both (every segment
/// checkpointed, each where the config does not have it already), added to `measured`, and the
/// staging they are planned with: the host budget and the link, from `[memory] link_bandwidth`
/// or measured by the offload profiles before their steps. `None` where the link could not be
/// measured (then no offload is offered, and the report says why).
fn staging(
    args: &PlanArgs,
    setting: &Setting,
    measured: &mut Vec<Measured>,
    host_budget: u64,
    memory: &MemorySection,
    say: &dyn Fn(&str),
) -> Result<Option<Staging>> {
    let current = (setting.offload_activations, setting.offload_optimizer);
    if current != (false, false) {
        // An offload candidate's compute is the same setting's without offload: measured too
        // where the config has offload on already.
        say("memsave plan: profiling without offload ...");
        let sets = vec![
            "offload.activations=false".to_string(),
            "offload.optimizer=false".to_string(),
        ];
        let measurement = run_worker(args, ("the config without offload", &sets), 0, true)?;
        measured.push(Measured {
            setting: Setting {
                offload_activations: false,
                offload_optimizer: false,
                weight_dtype: Default::default(),
                ..*setting
            },
            profile: measurement.profile,
        });
    }
    for (what, activations, optimizer) in [
        ("activation offload", true, false),
        ("optimizer offload", false, true),
        ("activation and optimizer offload", true, true),
    ] {
        let flags = (activations || current.0, optimizer || current.1);
        if flags == current {
            continue;
        }
        if measured
            .iter()
            .any(|m| (m.setting.offload_activations, m.setting.offload_optimizer) == flags)
        {
            continue;
        }
        say(&format!("memsave plan: profiling with {what} ..."));
        let sets = vec![
            format!("offload.activations={}", flags.0),
            format!("offload.optimizer={}", flags.1),
        ];
        let measurement = run_worker(args, (&format!("the config with {what}"), &sets), 0, true)?;
        measured.push(Measured {
            setting: Setting {
                offload_activations: flags.0,
                offload_optimizer: flags.1,
                weight_dtype: Default::default(),
                ..*setting
            },
            profile: measurement.profile,
        });
    }
    let measured_link = measured
        .iter()
        .map(|m| m.profile.link_bytes_per_second)
        .fold(0.0, f64::max);
    let (link_bytes_per_second, link_source) = match memory.link_bandwidth {
        Some(bandwidth) => (bandwidth.0, "memory.link_bandwidth".to_string()),
        None if measured_link > 0.0 => (
            measured_link,
            format!(
                "measured before profiling: 32 MiB each way, the slower way{}",
                if lavapipe(args) {
                    " (lavapipe: its device memory is host memory, so this is a memory copy, \
                     not a bus)"
                } else {
                    ""
                }
            ),
        ),
        None => {
            say(
                "memsave plan: the link between the device and host memory could not be \
                 measured: no offload is planned (give `[memory] link_bandwidth`)",
            );
            return Ok(None);
        }
    };
    Ok(Some(Staging {
        host_budget,
        link_bytes_per_second,
        link_source,
    }))
}

/// Whether the device is Mesa's lavapipe (a software Vulkan device).
fn lavapipe(args: &PlanArgs) -> bool {
    // Only wgpu's adapter can be lavapipe (asking CUDA would open a context in this process).
    args.device == Device::Wgpu
        && args
            .device
            .describe()
            .is_ok_and(|what| what.to_ascii_lowercase().contains("llvmpipe"))
}
