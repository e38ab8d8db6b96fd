//! `memsave train --devices N` and `--nodes M` with `memsave orchestrator`, on 127.0.0.1: rank 0
//! alone logs and saves, `--resume` restores every peer, two nodes reach the weights of two
//! local peers, a node killed mid-run ends the other with a message naming it, an unreachable
//! orchestrator is an error naming it. Every process runs under a deadline.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::memsave;

const TINY: &str = r#"
_base_ = "BASE"
[data]
type = "SyntheticClassification"
samples_per_gpu = 2
num_samples = 8
image_size = 16
[runner]
type = "EpochBasedRunner"
max_epochs = EPOCHS
[log_config]
interval = 1
[checkpoint_config]
interval = 1
max_keep_ckpts = -1
"#;

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("dist-cli", name)
}

fn config(dir: &Path, epochs: usize) -> PathBuf {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/resnet18_synthetic.toml");
    let path = dir.join("tiny.toml");
    let text = TINY
        .replace("BASE", base.to_str().unwrap())
        .replace("EPOCHS", &epochs.to_string());
    std::fs::write(&path, text).unwrap();
    path
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `memsave ARGS`, its stderr to `log`.
fn spawn(args: &[String], log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_memsave"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("the memsave binary runs")
}

/// Kills every child when dropped (a failed test leaves no process behind).
struct Reaper(Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits for child `i` to end, at most `seconds`.
fn wait(children: &mut Reaper, i: usize, seconds: u64, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = children.0[i].try_wait().unwrap() {
            return status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(seconds),
            "{what}: still running after {seconds} s (a hang)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The weights (and statistics) of a checkpoint of the tiny config's ResNet-18.
fn checkpoint_weights(path: &Path) -> Vec<f32> {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::prelude::Tensor;
    use memsave::models::classifier::ImageClassifier;
    use memsave::models::resnet::ResNetConfig;
    type B = burn::backend::Flex;
    struct All(Vec<f32>);
    impl ModuleVisitor<B> for All {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.extend(common::values(param.val()));
        }
    }
    let device = Default::default();
    let mut backbone = ResNetConfig::default();
    backbone.depth = 18;
    let model = ImageClassifier::<B>::new(&backbone, 4, &device).unwrap();
    let model = memsave::train::snapshot::load_weights::<B, _>(model, path, &device).unwrap();
    let mut all = All(Vec::new());
    model.visit(&mut all);
    all.0
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn train(config: &Path, work_dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "train",
        config.to_str().unwrap(),
        "--work-dir",
        work_dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    memsave(&args)
}

#[test]
fn two_local_peers_log_and_save_once_and_a_resume_restores_every_peer() {
    let root = dir("local");
    let config = config(&root, 2);
    let whole = root.join("whole");
    let output = train(&config, &whole, &["--devices", "2"]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("data parallel: 2 peers"), "{stderr}");
    // 8 samples over 2 peers at 2 a batch: 2 iterations an epoch, logged once each.
    let log = std::fs::read_to_string(whole.join("train.log")).unwrap();
    let lines = log.lines().filter(|l| l.starts_with("Epoch [")).count();
    assert_eq!(lines, 4, "{log}");
    // The base config's evaluation: once per epoch, by rank 0 only.
    let evaluations = log.lines().filter(|l| l.starts_with("Epoch(val)")).count();
    assert_eq!(evaluations, 2, "{log}");
    assert_eq!(stderr.matches("Epoch [").count(), 4, "{stderr}");
    let last = std::fs::read(whole.join("epoch_2.ckpt")).unwrap();

    // Resumed from the first epoch's checkpoint, both peers carry on as the whole run did.
    let resumed = root.join("resumed");
    let first = whole.join("epoch_1.ckpt");
    let output = train(
        &config,
        &resumed,
        &["--devices", "2", "--resume", first.to_str().unwrap()],
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let again = std::fs::read(resumed.join("epoch_2.ckpt")).unwrap();
    assert!(again == last, "the resumed run ended elsewhere");

    // Two peers train unlike one (twice the batch): the checkpoint differs from one peer's.
    let alone = root.join("alone");
    let output = train(&config, &alone, &[]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(std::fs::read(alone.join("epoch_2.ckpt")).unwrap() != last);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn two_nodes_on_loopback_reach_the_weights_of_two_local_peers() {
    let root = dir("nodes");
    let config = config(&root, 2);
    let local = root.join("local");
    let output = train(&config, &local, &["--devices", "2"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let a = checkpoint_weights(&local.join("epoch_2.ckpt"));
    // Plain, and ZeRO stage 2 (its gradients averaged in backward, the new values shared
    // between the processes): the same bits.
    for stage in [0, 2] {
        let nodes = root.join(format!("stage{stage}"));
        std::fs::create_dir_all(&nodes).unwrap();
        let port = free_port();
        let orchestrator = format!("ws://127.0.0.1:{port}");
        let mut children = Reaper(vec![spawn(
            &strings(&["orchestrator", "--port", &port.to_string()]),
            &nodes.join("orchestrator.log"),
        )]);
        std::thread::sleep(Duration::from_millis(500));
        for rank in 0..2 {
            let work = nodes.join(format!("node{rank}"));
            let args = strings(&[
                "train",
                config.to_str().unwrap(),
                "--work-dir",
                work.to_str().unwrap(),
                "--nodes",
                "2",
                "--node-rank",
                &rank.to_string(),
                "--orchestrator",
                &orchestrator,
                "--data-port",
                &free_port().to_string(),
                "--peer-timeout",
                "60",
                "--set",
                &format!("optimizer_config.zero_stage={stage}"),
            ]);
            children
                .0
                .push(spawn(&args, &nodes.join(format!("node{rank}.log"))));
        }
        for rank in 0..2 {
            let status = wait(&mut children, 1 + rank, 120, &format!("node {rank}"));
            let log = std::fs::read_to_string(nodes.join(format!("node{rank}.log"))).unwrap();
            assert!(status.success(), "stage {stage}, node {rank}: {log}");
        }
        let b = checkpoint_weights(&nodes.join("node0/epoch_2.ckpt"));
        let difference = common::max_relative_difference(&a, &b);
        eprintln!(
            "2 nodes at stage {stage} vs 2 local peers: max relative difference {difference:e}"
        );
        assert!(
            a == b,
            "2 nodes at stage {stage} ended with other weights than 2 local peers"
        );
        assert!(
            !nodes.join("node1/epoch_2.ckpt").exists(),
            "only rank 0 writes checkpoints"
        );
        drop(children);
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_node_killed_mid_run_ends_the_other_with_a_message_naming_it() {
    let root = dir("kill");
    let config = config(&root, 500);
    let port = free_port();
    let orchestrator = format!("ws://127.0.0.1:{port}");
    let mut children = Reaper(vec![spawn(
        &strings(&["orchestrator", "--port", &port.to_string()]),
        &root.join("orchestrator.log"),
    )]);
    std::thread::sleep(Duration::from_millis(500));
    for rank in 0..2 {
        let work = root.join(format!("node{rank}"));
        let args = strings(&[
            "train",
            config.to_str().unwrap(),
            "--work-dir",
            work.to_str().unwrap(),
            "--nodes",
            "2",
            "--node-rank",
            &rank.to_string(),
            "--orchestrator",
            &orchestrator,
            "--data-port",
            &free_port().to_string(),
            "--peer-timeout",
            "20",
        ]);
        children
            .0
            .push(spawn(&args, &root.join(format!("node{rank}.log"))));
    }
    // Once node 0 has written a checkpoint, node 1 dies.
    let first = root.join("node0/epoch_1.ckpt");
    let start = Instant::now();
    while !first.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint after 120 s"
        );
        assert!(
            children.0[1].try_wait().unwrap().is_none(),
            "node 0 ended early"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
    children.0[2].kill().unwrap();
    let killed = Instant::now();
    // burn-collective reports the lost node at once, or its transfer waits for it until the
    // peer timeout (20 s here).
    let status = wait(&mut children, 1, 90, "node 0 after node 1 was killed");
    let log = std::fs::read_to_string(root.join("node0.log")).unwrap();
    assert!(!status.success(), "{log}");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("data-parallel peer node 1"), "{log}");
    eprintln!(
        "node 0 ended {:.1} s after node 1 was killed",
        killed.elapsed().as_secs_f64()
    );
    // The checkpoints node 0 wrote are whole.
    let latest = root.join("node0/latest.ckpt");
    memsave::train::Snapshot::load(&latest).expect("the last checkpoint loads");
    drop(children);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_unreachable_orchestrator_and_bad_flags_are_errors_naming_them() {
    let root = dir("bad");
    let config = config(&root, 1);
    let work = root.join("work");
    let port = free_port();
    let address = format!("ws://127.0.0.1:{port}");
    let start = Instant::now();
    let output = train(
        &config,
        &work,
        &[
            "--nodes",
            "2",
            "--orchestrator",
            &address,
            "--data-port",
            &free_port().to_string(),
            "--peer-timeout",
            "3",
        ],
    );
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&address), "{stderr}");
    assert!(stderr.contains("--peer-timeout"), "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(60));

    for (flags, named) in [
        (vec!["--nodes", "2"], "--orchestrator"),
        (
            vec!["--nodes", "2", "--orchestrator", "127.0.0.1:9"],
            "--orchestrator",
        ),
        (
            vec![
                "--nodes",
                "2",
                "--node-rank",
                "2",
                "--orchestrator",
                "ws://127.0.0.1:9",
            ],
            "--node-rank",
        ),
        (vec!["--nodes", "1", "--node-rank", "1"], "--node-rank"),
        (vec!["--devices", "0"], "--devices"),
        (
            vec!["--devices", "2", "--peer-timeout", "0"],
            "--peer-timeout",
        ),
    ] {
        let output = train(&config, &work, &flags);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
    }
    let port = free_port();
    let _busy = std::net::TcpListener::bind(("0.0.0.0", port)).unwrap();
    let output = memsave(&["orchestrator", "--port", &port.to_string()]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&port.to_string()), "{stderr}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn zero_stages_over_two_local_peers_end_on_plain_data_parallelisms_weights() {
    // Two peers' processes that stop answering fail the test, not block CI.
    common::watchdog(600, || {
        let root = dir("zero");
        let config = config(&root, 2);
        let plain = root.join("plain");
        let output = train(&config, &plain, &["--devices", "2"]);
        assert!(output.status.success(), "{}", text(&output.stderr));
        let expected = checkpoint_weights(&plain.join("epoch_2.ckpt"));
        for stage in ["1", "2"] {
            let work = root.join(format!("zero{stage}"));
            let set = format!("optimizer_config.zero_stage={stage}");
            let output = train(&config, &work, &["--devices", "2", "--set", &set]);
            assert!(output.status.success(), "{}", text(&output.stderr));
            let weights = checkpoint_weights(&work.join("epoch_2.ckpt"));
            assert!(weights == expected, "stage {stage} ended elsewhere");
        }
        // A stage that does not exist, and sharding with nothing to shard across.
        let output = train(
            &config,
            &root.join("bad"),
            &["--devices", "2", "--set", "optimizer_config.zero_stage=3"],
        );
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("optimizer_config.zero_stage"), "{stderr}");
        let output = train(
            &config,
            &root.join("alone"),
            &["--set", "optimizer_config.zero_stage=1"],
        );
        let stderr = text(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        assert!(stderr.contains("nothing is sharded"), "{stderr}");
        let _ = std::fs::remove_dir_all(&root);
    });
}

#[test]
fn dynamic_runs_with_local_peers_each_keeping_its_budget_and_auto_is_refused_naming_dynamic() {
    let root = dir("dynamic");
    let config = config(&root, 1);
    // Two peers under a deadline: `with_cp` as given, a budget of 4 GiB each.
    let run = |with_cp: &str, name: &str| {
        let work = root.join(name);
        let log = root.join(format!("{name}.log"));
        let args = strings(&[
            "train",
            config.to_str().unwrap(),
            "--work-dir",
            work.to_str().unwrap(),
            "--devices",
            "2",
            "--set",
            &format!("model.backbone.with_cp=\"{with_cp}\""),
            "--set",
            "memory.memory_budget=\"4GiB\"",
        ]);
        let mut children = Reaper(vec![spawn(&args, &log)]);
        let status = wait(&mut children, 0, 300, name);
        (status, std::fs::read_to_string(&log).unwrap())
    };
    let (status, stderr) = run("dynamic", "dynamic");
    assert!(status.success(), "{stderr}");
    // Each peer profiles its own first step and states its own budget.
    assert_eq!(
        stderr.matches("dynamic: budget 4.0 GiB").count(),
        2,
        "{stderr}"
    );

    let (status, stderr) = run("auto", "auto");
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("model.backbone.with_cp") && stderr.contains("\"dynamic\""),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&root);
}
