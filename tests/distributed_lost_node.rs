//! A broken connection between nodes, reported by burn-collective's network tasks (memsave's
//! panic hook calls `report_network_failure`), stops a peer waiting in a collective call within
//! seconds, naming the lost node, instead of after the peer timeout. Its own test binary:
//! burn-collective's server of this process stays blocked in the call it never finishes.

mod common;

use std::time::{Duration, Instant};

use burn::backend::Flex;
use common::watchdog;
use memsave::parallel::{report_network_failure, run_local, Topology};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_broken_connection_stops_a_waiting_peer_within_seconds_naming_the_other_node() {
    let mut topology = Topology::local(1);
    topology.nodes = 2;
    topology.node_rank = 0;
    // Nothing listens there: burn-collective keeps trying to register.
    topology.orchestrator = Some(format!("ws://127.0.0.1:{}", free_port()));
    topology.data_port = free_port();
    topology.timeout = Duration::from_secs(600);
    let (error, elapsed) = watchdog(60, move || {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            report_network_failure("Failed to receive message from websocket (test)");
        });
        let start = Instant::now();
        let result = run_local::<Flex, (), _>(&topology, vec![Default::default()], |_| Ok(()));
        (result.unwrap_err().to_string(), start.elapsed())
    });
    assert!(
        error.contains("data-parallel peer node 1 (rank 1)"),
        "{error}"
    );
    assert!(
        error.contains("registering with the orchestrator"),
        "{error}"
    );
    assert!(error.contains("(test)"), "{error}");
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
}
