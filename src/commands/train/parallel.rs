//! Data parallelism: the `--devices`/`--nodes` flags and the peers of this process.

use burn::tensor::backend::AutodiffBackend;
use memsave::parallel::{run_local, Collective, Topology};

use super::{train_on, Job, TrainArgs};

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

/// Inner-backend device of an autodiff backend's.
type InnerDevice<B> =
    <<B as AutodiffBackend>::InnerBackend as burn::tensor::backend::BackendTypes>::Device;

/// The peers of this process, one per device, each training the whole job on its shard.
pub(super) fn train_parallel<B>(
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
