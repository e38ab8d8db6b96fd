//! Where the peers of a data-parallel run are, from the command line's flags, checked, and as
//! burn-collective's configuration.

use std::time::Duration;

use burn_collective::{AllReduceStrategy, CollectiveConfig};

use crate::{Error, Result};

/// Where the peers of a run are: `devices` peers in this process (one per device), on each of
/// `nodes` machines, this one being `node_rank`. Ranks are `node_rank * devices + local index`.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    /// Peers in this process.
    pub devices: usize,
    /// Processes (machines) in the run.
    pub nodes: usize,
    /// This process's place among them, from 0.
    pub node_rank: usize,
    /// The global orchestrator's address (`ws://HOST:PORT`), with several nodes.
    pub orchestrator: Option<String>,
    /// The address the other nodes reach this one's data service at (`ws://HOST:PORT`).
    pub node_address: Option<String>,
    /// The port this node's data service listens on.
    pub data_port: u16,
    /// How long a peer waits for the others in one collective call before it gives up.
    pub timeout: Duration,
}

/// The peer timeout unless one is given (NCCL's default in PyTorch).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

impl Topology {
    /// `devices` peers in this process, and no other node.
    pub fn local(devices: usize) -> Self {
        Topology {
            devices,
            nodes: 1,
            node_rank: 0,
            orchestrator: None,
            node_address: None,
            data_port: 0,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Peers in the whole run.
    pub fn world(&self) -> usize {
        self.devices * self.nodes
    }

    /// The ranks of this process's peers.
    pub fn local_ranks(&self) -> std::ops::Range<usize> {
        self.rank_of(0)..self.rank_of(self.devices.max(1))
    }

    /// The rank of this process's peer `local`.
    pub(crate) fn rank_of(&self, local: usize) -> usize {
        self.node_rank * self.devices + local
    }

    /// Whether the run spans several processes.
    pub(crate) fn is_multi_node(&self) -> bool {
        self.nodes > 1
    }

    /// A peer in words: `rank 1`, or `rank 3 (node 1)` across nodes.
    pub fn name(&self, rank: usize) -> String {
        if self.is_multi_node() {
            format!("rank {rank} (node {})", rank / self.devices.max(1))
        } else {
            format!("rank {rank}")
        }
    }

    /// Checks the values, naming the flag at fault.
    pub fn check(&self) -> Result<()> {
        if self.devices == 0 {
            return Err(Error::invalid("--devices", "must be at least 1, got 0"));
        }
        if self.nodes == 0 {
            return Err(Error::invalid("--nodes", "must be at least 1, got 0"));
        }
        if self.node_rank >= self.nodes {
            return Err(Error::invalid(
                "--node-rank",
                format!(
                    "must be below --nodes ({}), got {}",
                    self.nodes, self.node_rank
                ),
            ));
        }
        if self.is_multi_node() {
            let Some(orchestrator) = &self.orchestrator else {
                return Err(Error::invalid(
                    "--orchestrator",
                    "several nodes need the address of `memsave orchestrator` (ws://HOST:PORT)",
                ));
            };
            check_address("--orchestrator", orchestrator)?;
            if let Some(address) = &self.node_address {
                check_address("--node-address", address)?;
            }
            if self.data_port == 0 {
                return Err(Error::invalid(
                    "--data-port",
                    "must be a port number, got 0",
                ));
            }
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid("--peer-timeout", "must be positive, got 0"));
        }
        Ok(())
    }

    /// burn-collective's configuration for this topology.
    pub(super) fn config(&self) -> Result<CollectiveConfig> {
        // A tree within the process, and between nodes (a ring cannot reduce tensors with
        // fewer elements than there are nodes, such as the overflow flag).
        let mut config = CollectiveConfig::default()
            .with_num_devices(self.devices)
            .with_local_all_reduce_strategy(AllReduceStrategy::Tree(2));
        if self.is_multi_node() {
            let orchestrator = self.orchestrator.clone().unwrap_or_default();
            let node_address = self
                .node_address
                .clone()
                .unwrap_or_else(|| format!("ws://127.0.0.1:{}", self.data_port));
            config = config
                .with_num_nodes(self.nodes as u32)
                .with_global_address(parse_address("--orchestrator", &orchestrator)?)
                .with_node_address(parse_address("--node-address", &node_address)?)
                .with_data_service_port(self.data_port)
                .with_global_all_reduce_strategy(AllReduceStrategy::Tree(2));
        }
        Ok(config)
    }
}

fn check_address(flag: &str, address: &str) -> Result<()> {
    let rest = address.strip_prefix("ws://").ok_or_else(|| {
        Error::invalid(
            flag,
            format!("must be ws://HOST:PORT, got `{address}` (no ws:// prefix)"),
        )
    })?;
    let port = rest.rsplit_once(':').map(|(_, port)| port);
    match port.map(|port| port.trim_end_matches('/').parse::<u16>()) {
        Some(Ok(port)) if port > 0 => Ok(()),
        _ => Err(Error::invalid(
            flag,
            format!("must be ws://HOST:PORT, got `{address}` (no valid port)"),
        )),
    }
}

fn parse_address(flag: &str, address: &str) -> Result<burn_communication::Address> {
    check_address(flag, address)?;
    address
        .parse()
        .map_err(|error: String| Error::invalid(flag, error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_holds_the_ranks_of_its_devices() {
        let mut topology = Topology::local(3);
        assert_eq!(topology.local_ranks(), 0..3);
        topology.nodes = 2;
        topology.node_rank = 1;
        assert_eq!(topology.local_ranks(), 3..6);
        assert_eq!(topology.rank_of(1), 4);
    }
}
