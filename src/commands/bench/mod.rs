//! `memsave bench`: the strategy table of the source article, measured. RetinaNet R50-FPN on a
//! synthetic VOC set, the article's five configurations (`base`, `amp`, `accumulation`,
//! `checkpoint`, `all`) and three beyond them (`step_in_backward`, `int8_state`, `lean`),
//! each from the same config plus its one line, each in a process of its own
//! (`memsave bench-worker`, see [`worker`]) so that each peak starts clean; the processes take
//! their steps in turn, so that their times are interleaved. Prints a Markdown
//! table, writes `bench.json`, `bench_bars.png` and `bench_timeline.png` to `--out`.

mod measure;
mod plot;
pub mod report;
pub mod worker;

use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use memsave::{Error, Result};

use super::Device;
use report::{BenchReport, ConfigResult, CONFIGS, OFFLOAD_CONFIGS};

/// The default config: MMDetection's RetinaNet R50-FPN for VOC (its weights left random and its
/// data replaced by the synthetic set).
const DEFAULT_CONFIG: &str = include_str!("../../../configs/retinanet_r50_fpn_voc.toml");

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// A RetinaNet config (default: configs/retinanet_r50_fpn_voc.toml, built in, with random
    /// weights). Its model, optimizer and schedule are used; its data is replaced by `--data`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A VOC2007 folder (the devkit layout; `ImageSets/Main/trainval.txt` is used). Default: a
    /// synthetic set made in a temporary folder and removed afterwards.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Image size: `320` (square) or `WIDTHxHEIGHT` (`1000x600`); images are resized to it.
    #[arg(long, default_value = "320", value_parser = parse_size)]
    image_size: [usize; 2],
    /// Images per optimizer step (under accumulation: half of it per micro-batch, twice).
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Measured optimizer steps per configuration.
    #[arg(long, default_value_t = 4)]
    iters: usize,
    /// Unmeasured steps first (the optimizer's state is made by the first step).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// ResNet depth (18, 34, 50, 101, 152); the FPN's inputs follow.
    #[arg(long)]
    depth: Option<usize>,
    /// `sgd` (the config's) or `adam` (two moments: twice SGD's state).
    #[arg(long, value_enum, default_value = "sgd")]
    optimizer: OptimizerChoice,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Where `bench.json` and the pictures go.
    #[arg(long, default_value = "work_dirs/bench")]
    out: PathBuf,
    /// Another `bench.json` (e.g. `scripts/torch_reference.py`'s) to show beside this run.
    #[arg(long)]
    compare: Option<PathBuf>,
    /// Only these configurations (comma-separated), e.g. `base,checkpoint`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Override a config key for every configuration, as TOML.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The memory budget of the `planned` and `dynamic` configurations (`--only
    /// ...,planned,dynamic`): a share of the peak without checkpointing (`80%`) or bytes
    /// (`1.5GiB`).
    #[arg(long)]
    planned_budget: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerChoice {
    /// The config's optimizer (SGD with momentum in MMDetection's).
    Sgd,
    /// Adam, lr 1e-4.
    Adam,
}

/// `320` or `1000x600` (width x height) as `[height, width]`.
fn parse_size(text: &str) -> std::result::Result<[usize; 2], String> {
    let number = |t: &str| {
        t.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| (32..=8192).contains(&n))
            .ok_or_else(|| {
                format!("`{text}`: expected a side of 32 to 8192 pixels, or WIDTHxHEIGHT")
            })
    };
    match text.split_once(['x', 'X']) {
        Some((w, h)) => Ok([number(h)?, number(w)?]),
        None => {
            let side = number(text)?;
            Ok([side, side])
        }
    }
}

/// The budget of `planned` unless `--planned-budget` says otherwise: a share of its unplanned
/// peak (all the memory of its step: weights, optimizer state, gradients, activations).
pub const PLANNED_BUDGET: &str = "60%";

/// The config lines that switch a configuration on (over the batch of `base`).
pub fn strategy_lines(name: &str, batch: usize) -> Result<Vec<String>> {
    let amp = vec!["fp16.loss_scale=512.0".to_string()];
    let accumulation = vec![
        "optimizer_config.type=\"GradientCumulativeOptimizerHook\"".to_string(),
        "optimizer_config.cumulative_iters=2".to_string(),
        format!("data.samples_per_gpu={}", batch / 2),
    ];
    let checkpoint = vec!["model.backbone.with_cp=true".to_string()];
    // Beyond MMDetection: the neck and the head recomputed too.
    let neck_and_head = vec![
        "model.neck.with_cp=true".to_string(),
        "model.bbox_head.with_cp=true".to_string(),
    ];
    let step_in_backward = vec!["optimizer_config.step_in_backward=true".to_string()];
    let int8_state = vec!["optimizer.state_dtype=\"int8\"".to_string()];
    // Parameter compression: the trainable weights in bf16, stochastic rounding.
    let bf16_weights = vec!["optimizer.weight_dtype=\"bf16\"".to_string()];
    let offload_activations = vec!["offload.activations=true".to_string()];
    let offload_optimizer = vec!["offload.optimizer=true".to_string()];
    // The planner picks the blocks for a budget (`--planned-budget` sets another).
    let planned = vec![
        "model.backbone.with_cp=\"auto\"".to_string(),
        format!("memory.memory_budget=\"{PLANNED_BUDGET}\""),
    ];
    // Each step chooses its checkpoint set as it runs, for the same budget.
    let dynamic = vec![
        "model.backbone.with_cp=\"dynamic\"".to_string(),
        format!("memory.memory_budget=\"{PLANNED_BUDGET}\""),
    ];
    let base = vec![format!("data.samples_per_gpu={batch}")];
    if matches!(name, "accumulation" | "all" | "all_offload") && (batch < 2 || batch % 2 == 1) {
        return Err(Error::invalid(
            "--batch",
            format!(
                "`{name}` splits each step's {batch} images into 2 micro-batches: use an even \
                 batch, or leave it out with `--only`"
            ),
        ));
    }
    Ok(match name {
        "base" => base,
        "amp" => [base, amp].concat(),
        "accumulation" => accumulation,
        "checkpoint" => [base, checkpoint].concat(),
        "planned" => [base, planned].concat(),
        "dynamic" => [base, dynamic].concat(),
        "all" => [
            amp,
            accumulation,
            checkpoint,
            neck_and_head,
            step_in_backward,
        ]
        .concat(),
        "step_in_backward" => [base, step_in_backward].concat(),
        "int8_state" => [base, int8_state].concat(),
        // Every exact strategy that lowers the peak (accumulation keeps a whole set of sums
        // through its group, which the step in backward saves: left out), with 8-bit state.
        "lean" => [base, checkpoint, step_in_backward, int8_state].concat(),
        "bf16_weights" => [base, bf16_weights].concat(),
        "lean_bf16" => [base, checkpoint, step_in_backward, int8_state, bf16_weights].concat(),
        // CPU staging: activation offload moves what checkpointed segments keep, so every part
        // is checkpointed with it.
        "offload_activations" => [base, checkpoint, neck_and_head, offload_activations].concat(),
        "offload_optimizer" => [base, offload_optimizer].concat(),
        "all_offload" => [
            amp,
            accumulation,
            checkpoint,
            neck_and_head,
            step_in_backward,
            offload_activations,
            offload_optimizer,
        ]
        .concat(),
        other => {
            return Err(Error::invalid(
                "--only",
                format!(
                    "`{other}` is not a configuration: {}, {} (CPU staging, on a device), \
                     `planned` (the planner's checkpoint set for `--planned-budget`) or \
                     `dynamic` (each step's own set for `--planned-budget`)",
                    CONFIGS.join(", "),
                    OFFLOAD_CONFIGS.join(", ")
                ),
            ))
        }
    })
}

/// Every override of a configuration: the user's, its own lines, the planned budget.
fn config_lines(args: &BenchArgs, name: &str) -> Result<Vec<String>> {
    let mut lines: Vec<String> = args.set.clone();
    lines.extend(strategy_lines(name, args.batch)?);
    if let (Some(budget), "planned" | "dynamic") = (&args.planned_budget, name) {
        memsave::planner::Budget::parse(budget, "--planned-budget")?;
        lines.push(format!("memory.memory_budget=\"{budget}\""));
    }
    Ok(lines)
}

/// A folder removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub fn bench(args: BenchArgs) -> Result<()> {
    if args.iters == 0 {
        return Err(Error::invalid("--iters", "at least 1 measured step"));
    }
    if args.batch == 0 {
        return Err(Error::invalid("--batch", "at least 1 image per step"));
    }
    let names: Vec<String> = if args.only.is_empty() {
        let offload = match args.device {
            Device::Cpu => &[][..],
            _ => &OFFLOAD_CONFIGS[..],
        };
        CONFIGS
            .iter()
            .chain(offload)
            .map(|s| s.to_string())
            .collect()
    } else {
        args.only.iter().map(|s| s.trim().to_string()).collect()
    };
    for name in &names {
        strategy_lines(name, args.batch)?;
    }
    let device = device_words(args.device)?;
    let compare = args.compare.as_deref().map(BenchReport::read).transpose()?;
    if let Some(config) = &args.config {
        if !config.is_file() {
            return Err(Error::invalid(
                "--config",
                format!("{} does not exist or is not a file", config.display()),
            ));
        }
    }
    std::fs::create_dir_all(&args.out).map_err(io(&args.out))?;

    let temp = TempDir(std::env::temp_dir().join(format!("memsave-bench-{}", std::process::id())));
    std::fs::create_dir_all(&temp.0).map_err(io(&temp.0))?;
    let (config, random_init) = match &args.config {
        Some(path) => (path.clone(), false),
        None => {
            let path = temp.0.join("retinanet_r50_fpn_voc.toml");
            std::fs::write(&path, DEFAULT_CONFIG).map_err(io(&path))?;
            (path, true)
        }
    };
    // Each configuration's config, checked before anything runs.
    for name in &names {
        let sets = config_lines(&args, name)?;
        worker::load_config(
            &config,
            &sets,
            args.depth,
            args.optimizer == OptimizerChoice::Adam,
            random_init,
        )?;
    }
    let data = match &args.data {
        Some(dir) => dir.clone(),
        None => {
            // Two steps of distinct images; three in four synthetic images are trainval.
            let images = ((2 * args.batch * 4).div_ceil(3) + 1).max(8);
            eprintln!("memsave bench: making {images} synthetic VOC images");
            memsave::models::data::voc::synth::write_synthetic_voc(&temp.0, images, 0)?
        }
    };

    let configs = run_interleaved(&args, &names, &config, random_init, &data)?;
    for result in &configs {
        eprintln!(
            "memsave bench: {}: peak {:.1} MiB above the step's start, {:.2} s/step, final \
             loss {:.4}",
            result.name,
            report::mib(result.peak_bytes),
            result.median_iter_s,
            result.final_loss
        );
    }

    let model = model_words(&args);
    let report = BenchReport {
        device,
        model,
        image_size: args.image_size,
        batch: args.batch,
        iters: args.iters,
        framework: Some(format!("memsave {}", env!("CARGO_PKG_VERSION"))),
        optimizer: Some(
            match args.optimizer {
                OptimizerChoice::Sgd => "SGD",
                OptimizerChoice::Adam => "Adam",
            }
            .to_string(),
        ),
        configs,
    };
    let json = args.out.join("bench.json");
    let text = serde_json::to_string_pretty(&report).map_err(|e| Error::Data(e.to_string()))?;
    std::fs::write(&json, text).map_err(io(&json))?;
    println!("{}", report::table(&report));
    if let Some(theirs) = &compare {
        println!("{}", report::table(theirs));
        println!("{}", report::comparison(&report, theirs));
    }
    let bars = args.out.join("bench_bars.png");
    plot::bars(&bars, &report, compare.as_ref())?;
    let timeline = args.out.join("bench_timeline.png");
    plot::timeline(&timeline, &report, compare.as_ref())?;
    eprintln!(
        "memsave bench: wrote {}, {} and {}",
        json.display(),
        bars.display(),
        timeline.display()
    );
    Ok(())
}

fn model_words(args: &BenchArgs) -> String {
    match (&args.config, args.depth) {
        (None, None) => "RetinaNet R50-FPN".to_string(),
        (None, Some(depth)) => format!("RetinaNet R{depth}-FPN"),
        (Some(path), depth) => {
            let name = path.file_stem().unwrap_or_default().to_string_lossy();
            match depth {
                Some(depth) => format!("RetinaNet ({name}, depth {depth})"),
                None => format!("RetinaNet ({name})"),
            }
        }
    }
}

fn device_words(device: Device) -> Result<String> {
    device.describe()
}

/// One configuration's process and its progress bar.
struct Worker {
    name: String,
    process: super::worker::Worker<ConfigResult>,
    bar: ProgressBar,
}

/// Starts one configuration's process; it builds its model and data, then waits for a line on
/// its input before each step.
fn start(
    args: &BenchArgs,
    name: &str,
    config: &Path,
    random_init: bool,
    data: &Path,
    bars: &MultiProgress,
) -> Result<Worker> {
    let exe = std::env::current_exe().map_err(|e| Error::Data(e.to_string()))?;
    let mut command = Command::new(exe);
    command
        .arg("bench-worker")
        .args(["--name", name])
        .arg("--config")
        .arg(config)
        .arg("--data")
        .arg(data)
        .args(["--height", &args.image_size[0].to_string()])
        .args(["--width", &args.image_size[1].to_string()])
        .args(["--iters", &args.iters.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .arg("--paced")
        .args(["--device", args.device.as_arg()]);
    if let Some(depth) = args.depth {
        command.args(["--depth", &depth.to_string()]);
    }
    if args.optimizer == OptimizerChoice::Adam {
        command.arg("--adam");
    }
    if random_init {
        command.arg("--random-init");
    }
    for line in config_lines(args, name)? {
        command.arg(format!("--set={line}"));
    }
    let process = super::worker::spawn(&format!("the `{name}` run"), command)?;
    let total = (args.warmup + args.iters) as u64;
    let bar = bars.add(ProgressBar::new(total));
    bar.set_style(
        ProgressStyle::with_template("{prefix:>12} {bar:30} {pos}/{len} steps  {elapsed}")
            .expect("a valid template"),
    );
    bar.set_prefix(name.to_string());
    bar.tick();
    Ok(Worker {
        name: name.to_string(),
        process,
        bar,
    })
}

impl Worker {
    /// Lets the process run one step and waits for it; false once the process has ended.
    fn step(&mut self) -> bool {
        match self.process.step() {
            Some(done) => {
                self.bar.set_position(done);
                true
            }
            None => false,
        }
    }

    /// Waits for the process to end; its result, or its error in words.
    fn finish(self) -> Result<ConfigResult> {
        let finished = self.process.finish()?;
        self.bar.finish_and_clear();
        let name = &self.name;
        for warning in &finished.warnings {
            eprintln!("{name}: {warning}");
        }
        finished
            .result
            .map_err(|reason| Error::Data(format!("the `{name}` configuration failed: {reason}")))
    }
}

/// Runs the configurations' processes side by side, one step at a time in turn (the first
/// step of each, then the second of each, ...): each peak is its own process's, and the times
/// are interleaved, so that a noisy machine slows every configuration alike.
fn run_interleaved(
    args: &BenchArgs,
    names: &[String],
    config: &Path,
    random_init: bool,
    data: &Path,
) -> Result<Vec<ConfigResult>> {
    let bars = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
    let mut workers = Vec::new();
    for name in names {
        workers.push(start(args, name, config, random_init, data, &bars)?);
    }
    for _ in 0..args.warmup + args.iters {
        let mut any = false;
        for worker in &mut workers {
            any |= worker.step();
        }
        if !any {
            break;
        }
    }
    let mut results = Vec::new();
    let mut failure = None;
    for worker in workers {
        match worker.finish() {
            Ok(result) => results.push(result),
            Err(error) => {
                failure.get_or_insert(error);
            }
        }
    }
    match failure {
        Some(error) => Err(error),
        None => Ok(results),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("320"), Ok([320, 320]));
        assert_eq!(parse_size("1000x600"), Ok([600, 1000]));
        assert!(parse_size("abc").unwrap_err().contains("`abc`"));
        assert!(parse_size("16").is_err());
    }

    #[test]
    fn each_configuration_is_its_lines() {
        assert_eq!(
            strategy_lines("base", 2).unwrap(),
            ["data.samples_per_gpu=2"]
        );
        let all = strategy_lines("all", 4).unwrap();
        assert!(all.contains(&"data.samples_per_gpu=2".to_string()));
        assert!(all.contains(&"model.backbone.with_cp=true".to_string()));
        assert!(all.contains(&"model.neck.with_cp=true".to_string()));
        assert!(all.contains(&"model.bbox_head.with_cp=true".to_string()));
        assert!(all.contains(&"fp16.loss_scale=512.0".to_string()));
        assert!(strategy_lines("accumulation", 3).is_err());
        assert!(strategy_lines("fast", 2).is_err());
    }
}
