//! The measuring processes: `memsave plan-worker` (one measuring run) and its start from
//! `memsave plan`.

use std::path::PathBuf;
use std::process::Command;

use memsave::{Error, Result};

use super::PlanArgs;
use crate::commands::train::{Job, Measurement, TrainArgs};
use crate::commands::Device;

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
    crate::commands::worker::serve(|| crate::commands::train::run_job(&train, &job))
}

/// Runs one measuring process.
pub(super) fn run_worker(
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
    let worker = crate::commands::worker::spawn::<Measurement>("memsave plan-worker", command)?;
    worker.finish()?.result.map_err(|message| {
        Error::Data(format!(
            "memsave plan could not measure {what} ({}): {}",
            args.config.display(),
            message.trim_start_matches("data: ")
        ))
    })
}
