//! The `memsave` command line.

mod commands;
mod terminal;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use memsave::memory::CountingAllocator;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// GPU-memory savers for Burn training: mixed precision, gradient accumulation and gradient
/// checkpointing, switched on by one line of config.
#[derive(Parser, Debug)]
#[command(name = "memsave", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train the model of a TOML config (MMCV's section and switch names).
    Train(commands::train::TrainArgs),
    /// Run a trained detector on its config's test split, write its detections and print the
    /// VOC mAP table.
    Test(commands::test::TestArgs),
    /// The strategy table: RetinaNet under base, amp, accumulation, checkpoint and all three,
    /// each in a process of its own; peak memory, step time, where the memory goes, pictures.
    Bench(commands::bench::BenchArgs),
    /// One configuration of `memsave bench` (started by it).
    #[command(hide = true)]
    BenchWorker(commands::bench::worker::WorkerArgs),
    /// Where a config's memory goes, and the cheapest strategies (checkpoint set, mixed
    /// precision, accumulation, SGD, a smaller batch) that fit a memory budget.
    Plan(commands::plan::PlanArgs),
    /// One measuring run of `memsave plan` (started by it).
    #[command(hide = true)]
    PlanWorker(commands::plan::PlanWorkerArgs),
    /// Burn's global orchestrator for training on several machines: start it once, then
    /// `memsave train CONFIG --nodes M --node-rank R --orchestrator ws://HOST:PORT` on each.
    Orchestrator(commands::orchestrator::OrchestratorArgs),
    /// Data sets: make a synthetic VOC set, score a detections file.
    Data {
        #[command(subcommand)]
        command: commands::data::DataCommand,
    },
}

fn main() -> ExitCode {
    // A device's out-of-memory panic during a step becomes the runner's error, with advice:
    // its raw report and backtrace would only bury that.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = memsave::panic_text(info.payload()).unwrap_or_default();
        if memsave::memory::is_out_of_memory_panic(message) {
            return;
        }
        // burn-collective's network tasks panic when a node is lost; the peers then end with
        // an error naming it, so one line is enough here.
        let in_collective = info.location().is_some_and(|at| {
            at.file().contains("burn-collective") || at.file().contains("burn-communication")
        });
        if in_collective || std::thread::current().name() == Some("tokio-rt-worker") {
            eprintln!("memsave: burn-collective: {message}");
            memsave::parallel::report_network_failure(message);
            return;
        }
        report(info);
    }));
    // The library's warnings, notices, log lines and progress are events: printed here. Burn's
    // collective (data parallelism across machines) would log every connection and transfer
    // at INFO; warnings and errors are what a user needs of other crates.
    terminal::install();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(args),
        Command::Test(args) => commands::test::test(args),
        Command::Bench(args) => commands::bench::bench(args),
        Command::BenchWorker(args) => commands::bench::worker::worker(args),
        Command::Plan(args) => commands::plan::plan(args),
        Command::PlanWorker(args) => commands::plan::worker(args),
        Command::Data { command } => commands::data::run(command),
        Command::Orchestrator(args) => commands::orchestrator::orchestrator(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("memsave: error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `memsave train`. Under `with_cp = "dynamic"` on multi-scale training, the largest scale's
/// least is checked first, and a share budget is made the share of that scale's peak (one step
/// in a worker, as `memsave plan` measures it).
fn train(mut args: commands::train::TrainArgs) -> memsave::Result<()> {
    if !args.dist.is_parallel() {
        if let Some(line) = commands::plan::dynamic_budget_at_largest(&args)? {
            args.set.push(line);
        }
    }
    commands::train::train(args)
}
