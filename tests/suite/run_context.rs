//! One run, one context: two runs in one process (on two threads at once) each see their own
//! activation-offload setting, host limit and figures; a panic mid-step in one leaves the
//! other's right; a user's own loop holds a run of its own in a scope, and gets a step's failure
//! as an `Error` from `join_helpers`. Activation offload runs here on the CPU through the
//! host-resident switch (the same copier, prefetch, host limit and failures as on a device,
//! nothing saved), alone and with two data-parallel peers. Each run's state is its own: only the
//! tests with peers take the data-parallel tests' turn (burn-collective's server is one per
//! process). Its modules: errors that keep their causes (`errors`), and the library's
//! events instead of stderr (`events`).

use crate::common;
#[path = "run_context/errors.rs"]
mod errors;
#[path = "run_context/events.rs"]
mod events;

use std::sync::{Arc, Barrier};

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use common::{watchdog, AB};
use memsave::checkpoint::offload::{
    fail_next_prefetch, offload_stats, set_activation_offload, set_host_limit,
    stage_on_host_resident_backends, staging, StagingSupport,
};
use memsave::checkpoint::{join_helpers, set_with_cp, ActivationOffload, OffloadStats};
use memsave::hooks::{LrSchedule, LrUpdaterHook, OffloadHook, OptimizerHook};
use memsave::models::classifier::ClassificationBatch;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::train::{OptimizerKind, RunLength, Runner, TrainModel};
use memsave::{with_cp, Error, RunContext};

/// A block of the stack: checkpointed when its flag is on.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    linear: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear.forward(x).tanh()
    }
}

/// Four checkpointable blocks between a stem and a head; `panic_at`: the loss's call (from 0)
/// that panics after the blocks ran (their inputs offloaded), as a user's code might.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Stack<B: Backend> {
    stem: Linear<B>,
    #[with_cp]
    blocks: Vec<Block<B>>,
    head: Linear<B>,
}

const BLOCKS: u64 = 4;

impl<B: memsave::Backend> Stack<B> {
    fn new(device: &B::Device) -> Self {
        Stack {
            stem: LinearConfig::new(3 * 8 * 8, 64).init(device),
            blocks: (0..BLOCKS)
                .map(|_| Block {
                    linear: LinearConfig::new(64, 64).init(device),
                    with_cp: false,
                })
                .collect(),
            head: LinearConfig::new(64, 4).init(device),
        }
        .map(&mut common::tiny::Seeded(11))
    }

    fn logits(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let x = self.stem.forward(images.flatten::<2>(1, 3));
        let x = self.blocks.iter().fold(x, |x, block| block.forward(x));
        self.head.forward(x)
    }
}

thread_local! {
    /// The loss's call on this thread at which it panics, if any, and the calls so far.
    static PANIC_AT: std::cell::Cell<(Option<usize>, usize)> = const { std::cell::Cell::new((None, 0)) };
}

impl<B: AutodiffBackend + memsave::Backend> TrainModel<B> for Stack<B> {
    type Batch = ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        let logits = self.logits(batch.images);
        let (at, calls) = PANIC_AT.with(std::cell::Cell::get);
        PANIC_AT.with(|cell| cell.set((at, calls + 1)));
        if at == Some(calls) {
            panic!("the user's loss panicked at call {calls}");
        }
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.labels)
    }
}

fn data() -> SyntheticClassification<AB> {
    let mut config = SyntheticClassificationConfig::new(4, 16, 8);
    config.seed = 5;
    SyntheticClassification::new(config, 4, Default::default()).unwrap()
}

fn runner(
    name: &str,
    hook: OffloadHook,
    iters: usize,
) -> Runner<AB, Stack<AB>, SyntheticClassification<AB>> {
    let dir =
        std::env::temp_dir().join(format!("memsave-run-context-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut runner = Runner::new(
        set_with_cp(Stack::<AB>::new(&Default::default()), true),
        OptimizerKind::sgd(0.9),
        Box::new(OptimizerHook::new()),
        data(),
        RunLength::Iters(iters),
        &dir,
        Default::default(),
    )
    .unwrap();
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.01),
    }));
    runner.register_hook(Box::new(hook));
    runner
}

fn every_input(prefetch: usize) -> ActivationOffload {
    ActivationOffload {
        min_bytes: 1,
        max_in_flight: 64 << 20,
        prefetch,
    }
}

/// Staging on the CPU, in the run installed on this thread: the switch is the run's.
fn staging_here() {
    stage_on_host_resident_backends(true);
    assert_eq!(
        staging::<burn::backend::Flex>(),
        StagingSupport::Possible,
        "the host-resident switch lets staging run on the CPU"
    );
}

#[test]
fn two_runs_on_two_threads_see_their_own_settings_and_figures_and_a_panic_in_a_third_leaves_them_right(
) {
    let _panics = common::panicking_steps();
    watchdog(300, || {
        let start = Arc::new(Barrier::new(3));
        // Run A offloads every block's input; its figures must be its own.
        let a = std::thread::spawn({
            let start = start.clone();
            move || {
                let run = RunContext::named("A");
                let mut runner = run
                    .scope(|| {
                        staging_here();
                        runner("a", OffloadHook::new(every_input(2)), 3)
                    })
                    .unwrap();
                start.wait();
                runner.run().unwrap();
                (run, runner.into_model())
            }
        });
        // Run B has a host budget of 1 KiB: its first block's input (4 x 64 fp32, 1 KiB) fits,
        // the second's does not.
        let b = std::thread::spawn({
            let start = start.clone();
            move || {
                let run = RunContext::named("B");
                let mut runner = run
                    .scope(|| {
                        staging_here();
                        runner(
                            "b",
                            OffloadHook::new(every_input(0)).with_host_budget(Some(1024)),
                            3,
                        )
                    })
                    .unwrap();
                start.wait();
                (run, runner.run())
            }
        });
        // Run C panics in its second step's loss, after its blocks offloaded their inputs.
        let c = std::thread::spawn(move || {
            let run = RunContext::named("C");
            let mut runner = run
                .scope(|| {
                    staging_here();
                    PANIC_AT.with(|cell| cell.set((Some(1), 0)));
                    runner("c", OffloadHook::new(every_input(1)), 3)
                })
                .unwrap();
            start.wait();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runner.run()));
            (run, outcome.is_err())
        });
        let (run_a, _) = a.join().expect("run A");
        let (run_b, b_result) = b.join().expect("run B");
        let (run_c, c_panicked) = c.join().expect("run C's thread");

        let stats_a = OffloadStats::of(&run_a);
        assert_eq!(
            stats_a.segments,
            3 * BLOCKS,
            "A: 3 steps of 4 blocks: {stats_a:?}"
        );
        assert_eq!(stats_a.bytes, 3 * BLOCKS * 4 * 64 * 4, "A: {stats_a:?}");
        assert_eq!(
            stats_a.host_bytes, 0,
            "A: every input came back: {stats_a:?}"
        );
        assert!(stats_a.prefetched > 0, "A prefetched: {stats_a:?}");
        // Its setting was its own, and is gone with its run.
        assert_eq!(
            run_a
                .scope(memsave::checkpoint::activation_offload)
                .unwrap(),
            None
        );

        let error = b_result.expect_err("B's host budget is too small");
        let said = error.to_string();
        assert!(matches!(error, Error::OutOfMemory { .. }), "{said}");
        assert!(
            said.contains("iteration 0")
                && said.contains("`Block::forward` (the forward's offloaded segment 2)")
                && said.contains("1.0 KiB"),
            "{said}"
        );
        let stats_b = OffloadStats::of(&run_b);
        assert_eq!(
            stats_b.segments, 1,
            "B offloaded one segment, then stopped: {stats_b:?}"
        );
        assert_eq!(
            stats_b.host_bytes, 0,
            "B let its step's inputs go: {stats_b:?}"
        );

        assert!(c_panicked, "C's loss panicked");
        let stats_c = OffloadStats::of(&run_c);
        assert_eq!(
            stats_c.host_bytes, 0,
            "C let its step's inputs go: {stats_c:?}"
        );
        assert_eq!(
            stats_c.segments,
            2 * BLOCKS,
            "C: one step and a half: {stats_c:?}"
        );
    });
}

/// A user's own loop: a run of its own in a scope, activation offload switched on in it, and
/// the step's failures as values from `join_helpers` (the host past its limit in the forward,
/// a copy back lost in the backward), each naming the segment.
#[test]
fn a_users_loop_holds_its_run_in_a_scope_and_gets_a_steps_failure_from_join_helpers() {
    let _panics = common::panicking_steps();
    watchdog(300, || {
        let run = RunContext::named("my loop");
        let device = Default::default();
        let model = set_with_cp(Stack::<AB>::new(&device), true);
        let images = Tensor::<AB, 4>::ones([4, 3, 8, 8], &device);
        let step = |model: &Stack<AB>| {
            let grads = model.logits(images.clone()).sum().backward();
            let joined = join_helpers();
            (grads, joined)
        };
        run.scope(|| {
            staging_here();
            // Plain: the reference gradients.
            let (reference, joined) = step(&model);
            joined.unwrap();
            let reference = common::param_grads::<AB, _>(&model, &reference);
            assert_eq!(memsave::check::segments_ran(&model).unwrap(), None);

            set_activation_offload(Some(every_input(2)));
            let (grads, joined) = step(&model);
            joined.unwrap();
            assert_eq!(
                common::param_grads::<AB, _>(&model, &grads),
                reference,
                "offload gives the same gradients"
            );
            let stats = offload_stats();
            assert_eq!(stats.segments, BLOCKS, "{stats:?}");
            assert_eq!(stats.host_bytes, 0, "{stats:?}");

            // The host's limit: two inputs fit, the third does not.
            set_host_limit(Some(2 * 1024));
            let (_, joined) = step(&model);
            let error = joined.expect_err("past the host limit");
            let said = error.to_string();
            assert!(matches!(error, Error::OutOfMemory { .. }), "{said}");
            assert!(said.contains("offloaded segment 3"), "{said}");
            assert_eq!(offload_stats().host_bytes, 0, "the step's inputs let go");
            set_host_limit(None);

            // A copy back lost during a prefetch (the first segment the backward prefetches:
            // the third of the forward).
            fail_next_prefetch(Some("the device was lost (injected)".into()));
            // The copies to the host done before backward: one that has not run yet is
            // cancelled by its recomputation, and no copy back would be made to lose.
            let loss = model.logits(images.clone()).sum();
            memsave::checkpoint::wait_for_copies();
            let _ = loss.backward();
            let error = join_helpers().expect_err("a lost copy");
            let said = error.to_string();
            assert!(matches!(error, Error::Device { .. }), "{said}");
            assert!(
                said.contains("(injected)") && said.contains("`Block::forward`"),
                "{said}"
            );
            // The next step is whole again.
            let (grads, joined) = step(&model);
            joined.unwrap();
            assert_eq!(common::param_grads::<AB, _>(&model, &grads), reference);
        })
        .unwrap();

        // Outside the scope this thread's own run knows nothing of it.
        assert_eq!(memsave::checkpoint::activation_offload(), None);
        // A second run cannot be installed over it, and an ended run cannot be entered again.
        let other = RunContext::named("another loop");
        let _inside = run.enter().unwrap();
        let error = other.enter().err().expect("one run per thread").to_string();
        assert!(
            error.contains("`my loop`") && error.contains("`another loop`"),
            "{error}"
        );
        drop(_inside);
        run.end();
        let error = run.scope(|| ()).unwrap_err().to_string();
        assert!(
            error.contains("`my loop`") && error.contains("ended"),
            "{error}"
        );
    });
}

/// Without the switch, staging on the CPU is off, and a run that asks for it trains as without
/// it (nothing offloaded): the switch the tests above set is read.
#[test]
fn without_the_switch_the_cpu_offloads_nothing() {
    watchdog(120, || {
        assert_eq!(
            staging::<burn::backend::Flex>(),
            StagingSupport::NothingToSave
        );
        let run = RunContext::new();
        let mut runner = run
            .scope(|| runner("off", OffloadHook::new(every_input(2)), 2))
            .unwrap();
        runner.run().unwrap();
        assert_eq!(OffloadStats::of(&run), OffloadStats::default());
    });
}

/// Activation offload with two data-parallel peers on threads of one process: the peers share
/// their run (its host limit is the host's) and each offloads its own segments; every weight
/// after the run is the same bit as without offload.
#[test]
fn activation_offload_with_two_data_parallel_peers_trains_as_without_it() {
    use memsave::parallel::{Collective, ZeroStage};
    // burn-collective's local server is the process's: one data-parallel test at a time.
    let _turn = common::dp::turn();
    watchdog(300, || {
        let peers = |offload: bool| {
            let run = RunContext::new();
            let weights = run
                .scope(|| {
                    staging_here();
                    let dir = std::env::temp_dir().join(format!(
                        "memsave-run-context-{}-peers-{offload}",
                        std::process::id()
                    ));
                    common::dp::peers(2, |peer| {
                        let shard = peer.shard();
                        let mut runner = common::dp::peer_runner_with(
                            set_with_cp(Stack::<AB>::new(&Default::default()), true),
                            &OptimizerKind::sgd(0.9),
                            ZeroStage::Off,
                            OptimizerHook::new(),
                            data().with_shard(shard),
                            RunLength::Iters(3),
                            &dir,
                            peer,
                        );
                        if offload {
                            runner.register_hook(Box::new(OffloadHook::new(every_input(2))));
                        }
                        runner.run()?;
                        Ok(common::dp::weights(&runner.into_model()))
                    })
                })
                .unwrap()
                .unwrap();
            (weights, OffloadStats::of(&run))
        };
        let (plain, none) = peers(false);
        let (offloaded, stats) = peers(true);
        assert_eq!(none, OffloadStats::default());
        assert_eq!(plain[0], plain[1], "the peers agree");
        assert_eq!(offloaded, plain, "offload changed the weights");
        assert_eq!(
            stats.segments,
            2 * 3 * BLOCKS,
            "each peer offloaded its blocks at every step: {stats:?}"
        );
        assert_eq!(stats.host_bytes, 0, "{stats:?}");
        assert!(stats.prefetched > 0, "{stats:?}");
    });
}

/// A failure the step recorded before a panic is the run's error, not the panic: past the host
/// limit the forward goes on with the inputs on the device, and whatever fails after it (here
/// the user's loss) is not the cause.
#[test]
fn a_failure_recorded_before_a_panic_is_the_runs_error() {
    let _panics = common::panicking_steps();
    watchdog(120, || {
        let run = RunContext::new();
        let mut runner = run
            .scope(|| {
                staging_here();
                PANIC_AT.with(|cell| cell.set((Some(0), 0)));
                runner(
                    "failure-then-panic",
                    OffloadHook::new(every_input(0)).with_host_budget(Some(1024)),
                    2,
                )
            })
            .unwrap();
        let error = runner.run().expect_err("the host limit, as an error");
        let said = error.to_string();
        assert!(matches!(error, Error::OutOfMemory { .. }), "{said}");
        assert!(said.contains("offloaded segment 2"), "{said}");
    });
}

/// Data-parallel peers share their run, not their steps: a failure in one peer's step is that
/// peer's (its own loop's `join_helpers` returns it), and the other's is whole.
#[test]
fn a_peers_failure_is_its_own() {
    let _panics = common::panicking_steps();
    use std::sync::mpsc;
    use std::sync::Mutex;
    let _turn = common::dp::turn();
    watchdog(300, || {
        let run = RunContext::new();
        let (recorded, wait_recorded) = mpsc::channel::<()>();
        let (joined, wait_joined) = mpsc::channel::<()>();
        let signals = Mutex::new((Some(recorded), Some(wait_joined)));
        let waits = Mutex::new((Some(wait_recorded), Some(joined)));
        let outcomes = run
            .scope(|| {
                staging_here();
                set_activation_offload(Some(every_input(1)));
                fail_next_prefetch(Some("the device was lost (injected)".into()));
                common::dp::peers(2, |peer| {
                    use memsave::parallel::Collective;
                    let device = Default::default();
                    let images = Tensor::<AB, 4>::ones([4, 3, 8, 8], &device);
                    // Peer 0 checkpoints (and offloads, and meets the lost prefetch); peer 1
                    // does not.
                    let model = set_with_cp(Stack::<AB>::new(&device), peer.rank() == 0);
                    let loss = model.logits(images).sum();
                    // Its copies to the host done: one not yet made is cancelled by its
                    // recomputation, and no copy back would be made to lose.
                    memsave::checkpoint::wait_for_copies();
                    let _ = loss.backward();
                    let outcome = if peer.rank() == 0 {
                        let (recorded, wait_joined) = {
                            let mut signals = signals.lock().unwrap();
                            (signals.0.take().unwrap(), signals.1.take().unwrap())
                        };
                        // Peer 1 asks for its step's failure while peer 0's is recorded.
                        recorded.send(()).unwrap();
                        wait_joined.recv().unwrap();
                        join_helpers()
                    } else {
                        let (wait_recorded, joined) = {
                            let mut waits = waits.lock().unwrap();
                            (waits.0.take().unwrap(), waits.1.take().unwrap())
                        };
                        wait_recorded.recv().unwrap();
                        let outcome = join_helpers();
                        joined.send(()).unwrap();
                        outcome
                    };
                    Ok(outcome.map_err(|error| error.to_string()))
                })
            })
            .unwrap()
            .unwrap();
        let said = outcomes[0].clone().expect_err("peer 0's step failed");
        assert!(said.contains("(injected)"), "{said}");
        assert_eq!(outcomes[1], Ok(()), "peer 1's step is whole");
    });
}
