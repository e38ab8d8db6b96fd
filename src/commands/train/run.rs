//! A training run of a built model on the runner: its optimizer, hooks, plan and checkpoints.

use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;
use memsave::checkpoint::{set_with_cp_paths, CheckpointModule};
use memsave::config::{Config, ConfigHooks};
use memsave::models::registry::{Built, ModelJob};
use memsave::parallel::{Collective, PeerReducer};
use memsave::planner::{AutoPlanHook, DynamicHook, WithCp};
use memsave::train::params::OnThisHost;
use memsave::train::{DataSource, Hook, Runner, TrainModel};

use super::measure::measure;
use super::{Job, Peer, TrainArgs};

fn work_dir<M, D>(args: &TrainArgs, config: &Config<M, D>) -> PathBuf {
    args.work_dir
        .clone()
        .or_else(|| config.work_dir.clone())
        .unwrap_or_else(|| {
            let name = args.config.file_stem().unwrap_or_default();
            PathBuf::from("work_dirs").join(name)
        })
}

/// `memsave train`'s job (or `memsave plan`'s measuring one) on whatever model the config has.
pub(super) struct TrainJob<'a, B: AutodiffBackend> {
    pub(super) args: &'a TrainArgs,
    pub(super) job: &'a Job,
    pub(super) device: B::Device,
    pub(super) peer: Option<Peer<B>>,
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
    // "auto" with peers: not yet ("dynamic" keeps a budget per peer: each reads its own
    // meter, the bytes of its slot on the CPU, its device's elsewhere).
    if budget.is_some() && *with_cp == WithCp::Auto && args.dist.devices > 1 {
        return Err(memsave::Error::invalid(
            keys.with_cp,
            "\"auto\" profiles one training process, and --devices runs several peers in one: \
             plan with `memsave plan CONFIG --budget SIZE` and pin the blocks it prints \
             (`with_cp = [\"...\"]`), use \"dynamic\" (a budget per peer), or run one peer per \
             node (--devices 1)",
        ));
    }
    let planner: Option<Box<dyn Hook<B, M>>> = match budget {
        Some(budget) if *with_cp == WithCp::Dynamic => Some(Box::new(
            DynamicHook::new(budget, keys, &device)?.with_log_interval(config.log_config.interval),
        )),
        Some(budget) => Some(Box::new(
            AutoPlanHook::new(budget, config.planner_setting(batch), keys, &device)?
                .with_allow_approximate(config.memory.allow_approximate),
        )),
        None => None,
    };
    if let Job::Train = job {
        let zero = config.optimizer_config.zero()?;
        let host = match &peer {
            Some(peer) => OnThisHost {
                world: peer.world_size(),
                local: peer.local_ranks(),
                sharded: zero != memsave::parallel::ZeroStage::Off,
            },
            None => OnThisHost::alone(),
        };
        host_budget_holds(config, &model, &host)?;
    }
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
        runner.register_hook(planner);
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

/// Optimizer offload on a device with memory of its own: the host must hold the fp32 masters and
/// the optimizer's state of every peer on it (`host`: this process's) within `[memory]
/// host_budget` (default: half the machine's available memory), or the run stops before it
/// starts, naming the key and what fits.
fn host_budget_holds<B, S, D, M>(
    config: &Config<S, D>,
    model: &M,
    host: &OnThisHost,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    M: TrainModel<B>,
{
    if !config.offload.optimizer
        || memsave::checkpoint::offload::can_offload::<B::InnerBackend>().is_err()
    {
        return Ok(());
    }
    let Some(budget) = config.memory.host_budget()? else {
        return Ok(());
    };
    // Under accumulation, training alone, the group's fp32 sums are on the host too.
    let accumulates = config
        .optimizer_config
        .groups()
        .is_ok_and(|groups| groups.cumulative_iters() > 1);
    memsave::train::params::OffloadedOptimizer::of::<B, M>(
        model,
        config.optimizer().state_per_weight(),
        accumulates,
        host,
    )
    .within(budget)
    .map(drop)
}
