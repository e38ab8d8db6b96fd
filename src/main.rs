//! The `memsave` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use clap::{Parser, Subcommand, ValueEnum};
use memsave::config::Config;
use memsave::memory::CountingAllocator;
use memsave::models::classifier::ImageClassifier;
use memsave::models::config::{DataSection, ModelSection, ModelType};
use memsave::models::data::SyntheticClassification;
use memsave::train::Runner;

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
    Train(TrainArgs),
}

#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// The config file.
    config: PathBuf,
    /// Where checkpoints and the log go (default: the config's `work_dir`, else
    /// `work_dirs/<config name>`).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Continue a run from this checkpoint (weights, optimizer, loss scale, position).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Override a config key, as TOML: `--set optimizer_config.cumulative_iters=4`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Where to train.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

fn main() -> ExitCode {
    // A device's out-of-memory panic during a step becomes the runner's error, with advice:
    // its raw report and backtrace would only bury that.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if !memsave::memory::is_out_of_memory_panic(message) {
            report(info);
        }
    }));
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("memsave: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn train(args: TrainArgs) -> memsave::Result<()> {
    let config = Config::<ModelSection, DataSection>::load(&args.config, &args.set)?;
    let work_dir = args
        .work_dir
        .clone()
        .or_else(|| config.work_dir.clone())
        .unwrap_or_else(|| {
            let name = args.config.file_stem().unwrap_or_default();
            PathBuf::from("work_dirs").join(name)
        });
    match args.device {
        Device::Cpu => run::<Autodiff<Flex>>(&args, &config, work_dir, Default::default()),
        #[cfg(feature = "cuda")]
        Device::Cuda => {
            run::<Autodiff<burn::backend::Cuda>>(&args, &config, work_dir, Default::default())
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(memsave::Error::invalid(
            "--device",
            "this memsave was built without CUDA: rebuild with `--features cuda`",
        )),
    }
}

fn run<B: AutodiffBackend + memsave::Backend>(
    args: &TrainArgs,
    config: &Config<ModelSection, DataSection>,
    work_dir: PathBuf,
    device: B::Device,
) -> memsave::Result<()> {
    B::seed(&device, config.seed);
    let ModelType::ImageClassifier = config.model.kind;
    let num_classes = config.model.num_classes;
    let model = ImageClassifier::<B>::new(&config.model.backbone, num_classes, &device)?;
    let data = match &config.data {
        DataSection::SyntheticClassification(data) => {
            SyntheticClassification::<B>::new(data.clone(), num_classes, device.clone())?
        }
    };
    let mut runner = Runner::new(
        model,
        &config.optimizer_kind(),
        config.optimizer_hook()?,
        data,
        config.run_length()?,
        &work_dir,
        device,
    )?;
    for hook in config.hooks() {
        runner.register_hook(hook);
    }
    if let Some(checkpoint) = &args.resume {
        runner.resume(checkpoint)?;
        eprintln!(
            "memsave: resumed from {} at iteration {}",
            checkpoint.display(),
            runner.state().iter
        );
    }
    runner.run()?;
    eprintln!(
        "memsave: trained {} iterations; checkpoints and train.log in {}",
        runner.state().max_iters,
        work_dir.display()
    );
    Ok(())
}
