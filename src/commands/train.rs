//! `memsave train CONFIG`: the classifier or the detector of the config, on the runner with
//! its hooks.

use std::path::PathBuf;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use memsave::checkpoint::{set_with_cp_paths, CheckpointModule};
use memsave::config::{Config, LossScaleSpec};
use memsave::models::registry::{self, Built, ModelJob, Purpose, Setup};
use memsave::parallel::{run_local, BurnPeer, Collective, PeerReducer, Shard, Topology};
use memsave::planner::{AutoPlanHook, ProfileHook, StepMeter, WithCp};
use memsave::train::{DataSource, Hook, Runner, TrainModel};

use super::Device;

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

/// Data-parallel training on Burn's collective: `--devices N` peers in this process (one per
/// device), on each of `--nodes M` machines.
#[derive(clap::Args, Clone, Debug)]
pub struct DistArgs {
    /// Peers in this process, one per device: CUDA devices 0..N-1, or N peers sharing the CPU.
    /// `data.samples_per_gpu` is per peer.
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// Machines (processes) in the run, each started with the same flags but `--node-rank`.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// This machine's place among the nodes, from 0 (node 0 holds rank 0, which logs and saves).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// The address of `memsave orchestrator`: ws://HOST:PORT.
    #[arg(long, value_name = "ADDR")]
    pub orchestrator: Option<String>,
    /// The address the other nodes reach this one at (default ws://127.0.0.1:DATA_PORT).
    #[arg(long, value_name = "ADDR")]
    pub node_address: Option<String>,
    /// The port this node's tensor service listens on (default 3200 + node rank).
    #[arg(long)]
    pub data_port: Option<u16>,
    /// Seconds a peer waits for the others in one collective call before the run ends.
    #[arg(long, value_name = "SECONDS", default_value_t = 1800.0)]
    pub peer_timeout: f64,
}

impl Default for DistArgs {
    fn default() -> Self {
        DistArgs {
            devices: 1,
            nodes: 1,
            node_rank: 0,
            orchestrator: None,
            node_address: None,
            data_port: None,
            peer_timeout: 1800.0,
        }
    }
}

impl DistArgs {
    /// Whether the run is data parallel.
    pub fn is_parallel(&self) -> bool {
        self.devices != 1 || self.nodes != 1
    }

    /// The topology the flags describe, checked.
    pub fn topology(&self) -> memsave::Result<Topology> {
        if !(self.peer_timeout.is_finite() && self.peer_timeout > 0.0) {
            return Err(memsave::Error::invalid(
                "--peer-timeout",
                format!(
                    "must be a positive number of seconds, got {}",
                    self.peer_timeout
                ),
            ));
        }
        let topology = Topology {
            devices: self.devices,
            nodes: self.nodes,
            node_rank: self.node_rank,
            orchestrator: self.orchestrator.clone(),
            node_address: self.node_address.clone(),
            data_port: self
                .data_port
                .unwrap_or_else(|| 3200u16.saturating_add(self.node_rank as u16)),
            timeout: std::time::Duration::from_secs_f64(self.peer_timeout),
        };
        topology.check()?;
        Ok(topology)
    }
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

/// Inner-backend device of an autodiff backend's.
type InnerDevice<B> =
    <<B as AutodiffBackend>::InnerBackend as burn::tensor::backend::BackendTypes>::Device;

/// The peers of this process, one per device, each training the whole job on its shard.
fn train_parallel<B>(
    args: &TrainArgs,
    topology: &Topology,
    devices: Vec<(B::Device, InnerDevice<B>)>,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    B::InnerBackend: memsave::Backend,
{
    let inner: Vec<InnerDevice<B>> = devices.iter().map(|(_, inner)| inner.clone()).collect();
    let outer: Vec<B::Device> = devices.into_iter().map(|(outer, _)| outer).collect();
    if topology.node_rank == 0 {
        eprintln!(
            "memsave: data parallel: {} peers ({} per node on {} node(s)); gradients averaged \
             over all of them at every step, BatchNorm statistics per peer",
            topology.world(),
            topology.devices,
            topology.nodes
        );
    }
    run_local::<B::InnerBackend, (), _>(topology, inner, |peer| {
        let local = peer.rank() - topology.node_rank * topology.devices;
        let device = outer[local].clone();
        train_on::<B>(args, &Job::Train, device, peer.device().clone(), Some(peer))
    })?;
    Ok(())
}

fn work_dir<M, D>(args: &TrainArgs, config: &Config<M, D>) -> PathBuf {
    args.work_dir
        .clone()
        .or_else(|| config.work_dir.clone())
        .unwrap_or_else(|| {
            let name = args.config.file_stem().unwrap_or_default();
            PathBuf::from("work_dirs").join(name)
        })
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

/// `memsave train`'s job (or `memsave plan`'s measuring one) on whatever model the config has.
struct TrainJob<'a, B: AutodiffBackend> {
    args: &'a TrainArgs,
    job: &'a Job,
    device: B::Device,
    peer: Option<Peer<B>>,
}

impl<B> ModelJob<B> for TrainJob<'_, B>
where
    B: AutodiffBackend + memsave::Backend,
{
    type Output = ();

    fn run<S, D, M, Data>(
        self,
        config: &Config<S, D>,
        built: Built<B, M, Data>,
    ) -> memsave::Result<()>
    where
        M: TrainModel<B> + CheckpointModule,
        Data: DataSource<B, M::Batch> + 'static,
    {
        run(self.args, self.job, config, built, self.device, self.peer)
    }
}

fn run<B, S, D, M, Data>(
    args: &TrainArgs,
    job: &Job,
    config: &Config<S, D>,
    built: Built<B, M, Data>,
    device: B::Device,
    peer: Option<Peer<B>>,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    M: TrainModel<B> + CheckpointModule,
    Data: DataSource<B, M::Batch> + 'static,
{
    let Built {
        model,
        data,
        batch,
        hooks: extra,
        with_cp,
        keys,
    } = built;
    let work_dir = work_dir(args, config);
    let main = peer.as_ref().is_none_or(|peer| peer.rank() == 0);
    // Every (lazily initialised) weight drawn now, in one order: a checkpointed segment would
    // otherwise draw its own when it first runs, and checkpointing would change the start.
    memsave::train::params::param_bytes::<B, M>(&model);
    // `with_cp`: a pinned list of segments applies to the built model; "auto" plans.
    let with_cp = &with_cp;
    // A measuring job plans nothing: `memsave plan` gives it the checkpoint set to measure.
    let budget = match job {
        Job::Train => config.memory_budget(with_cp, &keys)?,
        Job::Measure { .. } => None,
    };
    let model = match with_cp {
        WithCp::Paths(paths) => set_with_cp_paths(model, paths)?,
        _ => model,
    };
    if let Job::Measure {
        warmup,
        iters,
        checkpoint_all,
    } = job
    {
        return measure(
            config,
            model,
            data,
            (*warmup, *iters, *checkpoint_all),
            device,
        );
    }
    if budget.is_some() && args.dist.devices > 1 {
        return Err(memsave::Error::invalid(
            keys.with_cp,
            "\"auto\" profiles one training process, and --devices runs several peers in \
             one: plan with `memsave plan CONFIG --budget SIZE` and pin the blocks it prints \
             (`with_cp = [\"...\"]`), or run one peer per node (--devices 1)",
        ));
    }
    let planner = match budget {
        Some(budget) => Some(
            AutoPlanHook::new(budget, config.planner_setting(batch), keys, &device)?
                .with_allow_approximate(config.memory.allow_approximate),
        ),
        None => None,
    };
    let zero = config.optimizer_config.zero()?;
    if zero != memsave::parallel::ZeroStage::Off && peer.is_none() && main {
        eprintln!(
            "memsave: warning: optimizer_config.zero_stage = {} shards the optimizer state \
             across data-parallel peers, and this run trains alone (--devices 1, --nodes 1): \
             nothing is sharded",
            zero.number()
        );
    }
    let optimizer_hook = config.optimizer_hook_of()?;
    let optimizer_hook: Box<dyn Hook<B, M>> = match &peer {
        Some(peer) => {
            let reducer = PeerReducer::<B::InnerBackend>::new(peer.clone(), peer.device())
                .with_zero_stage(config.optimizer_config.zero()?);
            Box::new(optimizer_hook.with_reducer(reducer))
        }
        None => Box::new(optimizer_hook),
    };
    let mut runner = Runner::new(
        model,
        config.optimizer(),
        optimizer_hook,
        data,
        config.run_length()?,
        &work_dir,
        device,
    )?;
    if let Some(peer) = peer {
        memsave::parallel::attach(&mut runner, peer);
    }
    if let Some(planner) = planner {
        // First after the optimizer hook: the profile starts right before the forward.
        runner.register_hook(Box::new(planner));
    }
    for hook in config.hooks() {
        runner.register_hook(hook);
    }
    for hook in extra {
        runner.register_hook(hook);
    }
    if let Some(checkpoint) = &args.resume {
        runner.resume(checkpoint)?;
        if main {
            eprintln!(
                "memsave: resumed from {} at iteration {}",
                checkpoint.display(),
                runner.state().iter
            );
        }
    }
    runner.run()?;
    if !main {
        return Ok(());
    }
    eprintln!(
        "memsave: trained {} iterations; checkpoints and train.log in {}",
        runner.state().max_iters,
        work_dir.display()
    );
    Ok(())
}

/// `warmup` steps, `iters` measured ones and a profiled one of `model` on `data`; the
/// [`Measurement`] reported to the parent.
fn measure<B, S, D, M, Data>(
    config: &Config<S, D>,
    model: M,
    data: Data,
    (warmup, iters, checkpoint_all): (usize, usize, bool),
    device: B::Device,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    M: TrainModel<B> + CheckpointModule,
    Data: DataSource<B, M::Batch> + 'static,
{
    let probe = || {
        memsave::memory::meter_for(&device).ok_or_else(|| {
            memsave::Error::invalid("--device", "the memory of this device cannot be read")
        })
    };
    let (parameters, trainable) = memsave::train::params::param_bytes::<B, M>(&model);
    let work_dir = std::env::temp_dir().join(format!("memsave-plan-{}", std::process::id()));
    // Whole optimizer steps: under accumulation a warm-up step is a whole group (the optimizer
    // state exists from the first step on), each measured step a group's micro-batches, and the
    // profiled micro-batch a group's last (the sums live, the step taken).
    let micro = config
        .optimizer_config
        .groups()
        .map_or(1, |groups| groups.cumulative_iters());
    let (warmup, iters) = (warmup * micro, iters * micro);
    // The measured steps must be steps the optimizer takes. A dynamic loss scale starts high
    // (65536; MMCV's 2^32) and skips its first steps on overflow: such a step has no update
    // and, with the step in backward, no second pass, so it would be measured cheaper than the
    // steps that follow. Measure at MMCV's static scale instead (the same memory and time for
    // a step taken).
    let mut hook = config.optimizer_hook_of()?;
    let mut scale = config.fp16.as_ref().map(|fp16| fp16.loss_scale.clone());
    if let Some(fp16) = &config.fp16 {
        if !matches!(fp16.loss_scale, LossScaleSpec::Static(_)) {
            let spec = LossScaleSpec::Static(memsave::scaler::MMCV_STATIC_SCALE);
            hook = hook.with_mixed_precision(spec.scaler()?, fp16.precision);
            scale = Some(spec);
        }
    }
    let mut runner = Runner::new(
        model,
        config.optimizer(),
        Box::new(hook),
        data,
        memsave::train::RunLength::Iters(warmup + iters + micro),
        &work_dir,
        device.clone(),
    )?;
    runner.register_hook_at(
        Box::new(memsave::hooks::LrUpdaterHook::new(config.lr_schedule())?),
        memsave::train::Priority::VeryHigh,
    );
    let meter = StepMeter::new(warmup, warmup + iters, probe()?);
    let steps = meter.steps.clone();
    let mut profiler = ProfileHook::new(warmup + iters + micro - 1, probe()?);
    profiler.checkpoint_all = checkpoint_all;
    let profile = profiler.profile.clone();
    runner.register_hook(Box::new(meter));
    runner.register_hook(Box::new(profiler));
    let copies = runner.state().optimizer_state_per_weight;
    runner.run()?;
    let _ = std::fs::remove_dir_all(&work_dir);
    let profile = profile.take().ok_or_else(|| match scale {
        Some(LossScaleSpec::Static(scale)) if runner.state().log.overflow => {
            memsave::Error::Data(format!(
                "the profiled step's gradients overflowed (inf or NaN) at the static loss \
                 scale {scale}, so the step was skipped and cannot be measured; set a smaller \
                 `fp16.loss_scale`"
            ))
        }
        _ => memsave::Error::Data("the profiled step did not run".into()),
    })?;
    let measurement = Measurement {
        steps: steps.take(),
        profile,
        parameters,
        trainable,
        optimizer_state_per_weight: copies,
    };
    super::worker::send(&super::worker::Report::Done(measurement))
}
