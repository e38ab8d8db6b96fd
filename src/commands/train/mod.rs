//! `memsave train CONFIG`: the classifier or the detector of the config, on the runner with
//! its hooks.

mod measure;
mod parallel;
mod run;

use std::path::PathBuf;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use memsave::models::registry::{self, Purpose, Setup};
use memsave::parallel::{BurnPeer, Collective, Shard};

use super::Device;
use parallel::train_parallel;
pub use parallel::DistArgs;
use run::TrainJob;

/// One peer of a data-parallel run, as the runner holds it.
type Peer<B> = Arc<BurnPeer<<B as AutodiffBackend>::InnerBackend>>;

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// The config file.
    pub config: PathBuf,
    /// Where checkpoints and the log go (default: the config's `work_dir`, else
    /// `work_dirs/<config name>`).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Continue a run from this checkpoint (weights, optimizer, loss scale, position).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Override a config key, as TOML: `--set optimizer_config.cumulative_iters=4`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Where to train.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: Device,
    /// Data parallelism (MMCV's distributed training).
    #[command(flatten)]
    pub dist: DistArgs,
}

pub fn train(args: TrainArgs) -> memsave::Result<()> {
    run_job(&args, &Job::Train)
}

/// What to do with a config's model and data: train it, or measure some of its steps for
/// `memsave plan` (in a process of its own, so that its peak is clean).
#[derive(Clone, Debug)]
pub enum Job {
    /// `memsave train`.
    Train,
    /// `warmup` steps, `iters` measured steps (time, peak), then one step profiled (with every
    /// segment checkpointed when `checkpoint_all`); the result reported to the parent
    /// ([`super::worker::Report::Done`]).
    Measure {
        warmup: usize,
        iters: usize,
        checkpoint_all: bool,
    },
}

/// What a measuring job writes.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Measurement {
    /// Per measured step: seconds and peak live bytes.
    pub steps: Vec<(f64, u64)>,
    /// The profiled step.
    pub profile: memsave::planner::Profile,
    /// Bytes of every parameter (weights and statistics) and of the trainable ones.
    pub parameters: u64,
    /// See `parameters`.
    pub trainable: u64,
    /// Bytes of optimizer state per byte of trainable weights.
    pub optimizer_state_per_weight: f64,
}

pub fn run_job(args: &TrainArgs, job: &Job) -> memsave::Result<()> {
    // The flags are checked even for one process: `--nodes 1 --node-rank 1` is no rank 0.
    args.dist.topology()?;
    if args.dist.is_parallel() {
        if !matches!(job, Job::Train) {
            return Err(memsave::Error::invalid(
                "--devices",
                "measuring runs (memsave plan) use one device",
            ));
        }
        let topology = args.dist.topology()?;
        // A config error is the config's, said once, before any peer starts.
        registry::entry(&args.config, &args.set)?;
        args.device.describe()?;
        return match args.device {
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                // CUDA devices 0..N (an index past the last is the peer's error).
                let devices = (0..topology.devices)
                    .map(|i| {
                        let device = burn::backend::cuda::CudaDevice::new(i);
                        (device.clone(), device)
                    })
                    .collect();
                train_parallel::<Autodiff<burn::backend::Cuda>>(args, &topology, devices)
            }
            // N peers sharing the CPU, or wgpu's default device (its runtime numbers adapters
            // by kind, not by index: one device, as the CPU).
            device => crate::on_backend!(device, K => train_parallel::<Autodiff<K>>(
                args,
                &topology,
                vec![(Default::default(), Default::default()); topology.devices],
            )),
        };
    }
    crate::on_backend!(args.device, K => train_on::<Autodiff<K>>(
        args,
        job,
        Default::default(),
        Default::default(),
        None,
    ))
}

/// Trains on `B` (on `device`); the evaluation runs on its inner backend (on `inner`, the same
/// device).
fn train_on<B>(
    args: &TrainArgs,
    job: &Job,
    device: B::Device,
    inner: <B::InnerBackend as burn::tensor::backend::BackendTypes>::Device,
    peer: Option<Peer<B>>,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    B::InnerBackend: memsave::Backend,
{
    let shard = peer.as_ref().map_or(Shard::whole(), |peer| peer.shard());
    let setup = Setup::<B> {
        config: &args.config,
        sets: &args.set,
        purpose: match job {
            Job::Train => Purpose::Train,
            Job::Measure { .. } => Purpose::Measure,
        },
        device: device.clone(),
        inner,
        shard,
    };
    registry::build(
        setup,
        TrainJob {
            args,
            job,
            device,
            peer,
        },
    )
}
