//! Peers on burn-collective, and running a group of them with failures contained.
//!
//! burn-collective's calls block until every peer has made the same call, without a time limit.
//! Each [`BurnPeer`] makes them on a thread of its own and waits for the answer in short steps,
//! so that it stops waiting as soon as another peer of the group has failed (the group's
//! failure is recorded first, then burn-collective's local server is reset, which ends the calls
//! pending there with an error) or when no answer came within the peer timeout (a node on
//! another machine that died or cannot be reached).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;
use burn_collective::{CollectiveError, PeerId, ReduceOperation};

pub use super::topology::{Topology, DEFAULT_TIMEOUT};
use super::{Collective, Reduce};
use crate::{Error, Result};

/// The call that ends a peer's registration (a node may close its connections meanwhile).
const FINISHING: &str = "finishing";

/// How long a call may still be answered after a transfer between nodes broke (the other node
/// may have ended normally, closing its connections, just before the answer came).
const NETWORK_GRACE: Duration = Duration::from_secs(2);

/// When and how one of burn-collective's network tasks failed in this process.
static NETWORK_FAILURE: Mutex<Option<(Instant, String)>> = Mutex::new(None);

/// Reports that one of burn-collective's network tasks failed (a panic on its runtime when a
/// connection to another node broke; `memsave`'s panic hook calls this). The peers of a
/// multi-node run waiting in a collective call then stop within `NETWORK_GRACE`, naming the
/// lost node, instead of waiting out the peer timeout. The first report counts.
pub fn report_network_failure(detail: &str) {
    let mut failure = NETWORK_FAILURE.lock().unwrap_or_else(|e| e.into_inner());
    if failure.is_none() {
        *failure = Some((Instant::now(), detail.to_string()));
    }
}

fn network_failure() -> Option<(Instant, String)> {
    NETWORK_FAILURE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// What the peers of one process share: the first failure among them (the peer in words, what
/// happened, and the rank whose own error it was, where it failed in this process).
#[derive(Default)]
struct Group {
    failure: Mutex<Option<(String, String, Option<usize>)>>,
}

impl Group {
    /// Records the failure of peer `name` (rank `rank`) with `error` (the first failure only:
    /// the others follow from it) and wakes the peers blocked in burn-collective's local server.
    /// Whether it was the first.
    fn fail<B: Backend>(&self, error: &Error, name: &str, rank: usize) -> bool {
        let (peer, message, own) = match error {
            Error::Peer { peer, message, .. } => (peer.clone(), message.clone(), None),
            other => (name.to_string(), other.to_string(), Some(rank)),
        };
        let first = {
            let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            if failure.is_some() {
                false
            } else {
                *failure = Some((peer, message, own));
                true
            }
        };
        if first {
            reset::<B>();
        }
        first
    }

    fn failure(&self) -> Option<(String, String, Option<usize>)> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Resets burn-collective's local server: the calls pending there end with an error, and the
/// next run registers afresh. A server that has already stopped (its task panicked when a node
/// was lost) needs none: the panic of sending to it is caught.
fn reset<B: Backend>() {
    // burn-collective panics when its server's task has ended: nothing is left to reset then.
    let _ = catch_unwind(burn_collective::reset_collective::<B>);
}

type Job = Box<dyn FnOnce() + Send>;

/// One peer on burn-collective (see the [module docs](self)).
pub struct BurnPeer<B: Backend> {
    rank: usize,
    topology: Topology,
    id: PeerId,
    device: B::Device,
    group: Arc<Group>,
    jobs: Mutex<Sender<Job>>,
}

impl<B: Backend> BurnPeer<B> {
    fn start(topology: &Topology, local: usize, device: B::Device, group: Arc<Group>) -> Self {
        let rank = topology.rank_of(local);
        let (jobs, queue) = mpsc::channel::<Job>();
        // The thread that makes the blocking calls; it ends when the peer is dropped (or stays
        // blocked in a call that will never be answered, until the process ends).
        let _ = std::thread::Builder::new()
            .name(format!("memsave-collective-{rank}"))
            .spawn(move || {
                while let Ok(job) = queue.recv() {
                    job();
                }
            });
        BurnPeer {
            rank,
            topology: topology.clone(),
            id: PeerId::from(rank),
            device,
            group,
            jobs: Mutex::new(jobs),
        }
    }

    /// The device this peer trains on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// This peer in words (`rank 1`).
    pub fn name(&self) -> String {
        self.topology.name(self.rank)
    }

    /// Runs `call` on the peer's thread and waits for its answer (see the module docs).
    fn call<T: Send + 'static>(
        &self,
        what: &str,
        call: impl FnOnce() -> std::result::Result<T, CollectiveError> + Send + 'static,
    ) -> Result<T> {
        if let Some(failure) = self.stopped() {
            return Err(failure);
        }
        let (reply, answer): (Sender<_>, Receiver<_>) = mpsc::channel();
        let job: Job = Box::new(move || {
            let _ = reply.send(call());
        });
        if self
            .jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job)
            .is_err()
        {
            return Err(self.error(what, "its collective thread has ended".to_string()));
        }
        let start = Instant::now();
        let finishing = what == FINISHING;
        loop {
            match answer.recv_timeout(Duration::from_millis(20)) {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(error)) => {
                    if let Some(failure) = self.stopped() {
                        return Err(failure);
                    }
                    let error = match &error {
                        CollectiveError::Global(_) | CollectiveError::LocalServerMissing
                            if self.topology.is_multi_node() =>
                        {
                            self.lost(what, &error)
                        }
                        _ => self.error(what, describe(&error)),
                    };
                    self.group.fail::<B>(&error, &self.name(), self.rank);
                    return Err(error);
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(failure) = self.stopped() {
                        return Err(failure);
                    }
                    // A transfer between nodes broke: burn-collective's call may wait for the
                    // lost node until the peer timeout; stop once the answer is overdue.
                    if self.topology.is_multi_node() && !finishing {
                        if let Some((at, detail)) = network_failure() {
                            if at.elapsed() >= NETWORK_GRACE && start.elapsed() >= NETWORK_GRACE {
                                let error = self.lost_because(what, &detail);
                                self.group.fail::<B>(&error, &self.name(), self.rank);
                                return Err(error);
                            }
                        }
                    }
                    if start.elapsed() >= self.topology.timeout {
                        let error = Error::Peer {
                            peer: if self.topology.is_multi_node() {
                                self.other_node()
                            } else {
                                "another".to_string()
                            },
                            message: format!(
                                "{} waited {:.0?} for the others in {what} and got no answer: a \
                                 peer stopped, hangs, or cannot be reached ({} peers on {} \
                                 node(s); --peer-timeout sets the wait)",
                                self.name(),
                                self.topology.timeout,
                                self.topology.world(),
                                self.topology.nodes
                            ),
                            source: None,
                        };
                        self.group.fail::<B>(&error, &self.name(), self.rank);
                        return Err(error);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    if let Some(failure) = self.stopped() {
                        return Err(failure);
                    }
                    // burn-collective's server panicked under the call (a lost connection).
                    let error = if self.topology.is_multi_node() {
                        self.lost(what, &CollectiveError::LocalServerMissing)
                    } else {
                        self.error(what, "burn-collective's server stopped".to_string())
                    };
                    self.group.fail::<B>(&error, &self.name(), self.rank);
                    return Err(error);
                }
            }
        }
    }

    /// The error that stops this peer because another one failed, if one did.
    fn stopped(&self) -> Option<Error> {
        self.group.failure().map(|(peer, message, _)| {
            let message = if peer == self.name() {
                message
            } else {
                format!("{message} (so {} stopped too)", self.name())
            };
            Error::Peer {
                peer,
                message,
                source: None,
            }
        })
    }

    fn error(&self, what: &str, message: String) -> Error {
        Error::Peer {
            peer: self.name(),
            message: format!("{what}: {message}"),
            source: None,
        }
    }

    /// The error for a node lost in the middle of a call: its connection broke or it stopped
    /// answering. burn-collective numbers nodes in the order they registered, not by
    /// `--node-rank`, so the node is named by rank when there are two, else left open.
    fn lost(&self, what: &str, error: &CollectiveError) -> Error {
        self.lost_because(what, &describe(error))
    }

    fn lost_because(&self, what: &str, detail: &str) -> Error {
        Error::Peer {
            peer: self.other_node(),
            message: format!(
                "lost during {what}, seen from {}: the node stopped or its connection broke \
                 ({detail})",
                self.name(),
            ),
            source: None,
        }
    }

    /// The node a failure between nodes is blamed on: the other one, when there are two.
    fn other_node(&self) -> String {
        if self.topology.nodes == 2 {
            let other = 1 - self.topology.node_rank;
            let first = other * self.topology.devices;
            match self.topology.devices {
                1 => format!("node {other} (rank {first})"),
                n => format!("node {other} (ranks {first}-{})", first + n - 1),
            }
        } else {
            "on another node".to_string()
        }
    }

    fn register(&self) -> Result<()> {
        let config = self.topology.config()?;
        let (id, device) = (self.id, self.device.clone());
        let what = if self.topology.is_multi_node() {
            format!(
                "registering with the orchestrator at {}",
                self.topology.orchestrator.clone().unwrap_or_default()
            )
        } else {
            "registering with the other peers".to_string()
        };
        self.call(&what, move || {
            burn_collective::register::<B>(id, device, config)
        })
    }

    fn finish(&self) -> Result<()> {
        let id = self.id;
        self.call(FINISHING, move || {
            burn_collective::finish_collective::<B>(id)
        })
    }
}

impl<B: Backend> Collective<B> for BurnPeer<B> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.topology.world()
    }

    fn local_ranks(&self) -> std::ops::Range<usize> {
        self.topology.local_ranks()
    }

    fn all_reduce(&self, tensor: FloatTensor<B>, op: Reduce) -> Result<FloatTensor<B>> {
        let id = self.id;
        let op = match op {
            Reduce::Sum => ReduceOperation::Sum,
            Reduce::Mean => ReduceOperation::Mean,
        };
        self.call("an all-reduce", move || {
            burn_collective::all_reduce::<B>(id, tensor, op)
        })
    }
}

/// burn-collective's error in words.
fn describe(error: &CollectiveError) -> String {
    match error {
        CollectiveError::LocalServerMissing => {
            "the collective was reset (another peer stopped)".to_string()
        }
        CollectiveError::Global(global) => format!("between nodes: {global:?}"),
        other => format!("{other:?}"),
    }
}

/// Runs `body` on `devices.len()` peers of `topology` in this process, one thread each, and
/// returns their results in rank order. When a peer fails (an error, or a panic), every other
/// peer stops at its next collective call, and the result is an [`Error::Peer`] naming the
/// first one that failed, with its error; nothing waits forever.
pub fn run_local<B, T, F>(topology: &Topology, devices: Vec<B::Device>, body: F) -> Result<Vec<T>>
where
    B: Backend,
    T: Send,
    F: Fn(Arc<BurnPeer<B>>) -> Result<T> + Sync,
{
    topology.check()?;
    if devices.len() != topology.devices {
        return Err(Error::invalid(
            "--devices",
            format!(
                "{} devices were given for {} peers",
                devices.len(),
                topology.devices
            ),
        ));
    }
    // A run before this one in the same process may have left peers registered, or a broken
    // connection behind.
    reset::<B>();
    *NETWORK_FAILURE.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let group = Arc::new(Group::default());
    // The peers are one run: each trains in the caller's (its host limit is the host's).
    let inherited = crate::run::inherit();
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .into_iter()
            .enumerate()
            .map(|(local, device)| {
                let group = group.clone();
                let body = &body;
                let inherited = inherited.clone();
                std::thread::Builder::new()
                    .name(format!("memsave-peer-{}", topology.rank_of(local)))
                    .spawn_scoped(scope, move || {
                        // Its own memory slot: its bytes are counted apart from the other
                        // peers' (`memory::peer_meter_for`).
                        let _run = inherited.install_as_owner(crate::memory::fresh_slot());
                        let peer = Arc::new(BurnPeer::<B>::start(topology, local, device, group));
                        let name = peer.name();
                        // A thread boundary: the peer's body is the user's code and may panic;
                        // the group then stops every peer and names this one.
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            peer.register()?;
                            let value = body(peer.clone())?;
                            peer.finish()?;
                            Ok(value)
                        }));
                        let outcome = match outcome {
                            Ok(outcome) => outcome,
                            Err(payload) => Err(Error::Peer {
                                peer: name.clone(),
                                message: format!(
                                    "panicked: {}",
                                    crate::panic_text(payload.as_ref()).unwrap_or("(no message)")
                                ),
                                source: None,
                            }),
                        };
                        if let Err(error) = &outcome {
                            peer.group.fail::<B>(error, &name, peer.rank);
                        }
                        outcome
                    })
                    .expect("spawning a peer thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle.join().unwrap_or_else(|_| {
                    Err(Error::Peer {
                        peer: "unknown".into(),
                        message: "a peer thread died".into(),
                        source: None,
                    })
                })
            })
            .collect()
    });
    reset::<B>();
    if let Some((peer, message, own)) = group.failure() {
        // The failing peer's own error, where it failed in this process, as the cause (the
        // others' are only that they stopped).
        let source = own
            .and_then(|rank| (0..results.len()).find(|&local| topology.rank_of(local) == rank))
            .and_then(|local| results.into_iter().nth(local))
            .and_then(Result::err)
            .map(Box::new);
        return Err(Error::Peer {
            peer,
            message,
            source,
        });
    }
    results.into_iter().collect()
}

/// Runs burn-collective's global orchestrator on `port` (all interfaces) until the process is
/// interrupted: the nodes of a multi-machine run register with it and learn each other's
/// addresses. A port that cannot be bound is an error naming it.
pub fn serve_orchestrator(port: u16) -> Result<()> {
    // burn-collective only logs a failure to bind: check the port first.
    std::net::TcpListener::bind(("0.0.0.0", port)).map_err(|error| {
        Error::invalid("--port", format!("cannot listen on port {port}: {error}"))
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|error| {
            Error::Data(format!("cannot start the orchestrator's runtime: {error}"))
        })?;
    runtime.block_on(burn_collective::start_global_orchestrator(port));
    Ok(())
}
