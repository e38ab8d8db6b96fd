//! Optimizer offload on Burn 0.22 (`OptimizerHook::with_optimizer_offload`, `[offload]
//! optimizer = true`): the optimizer's state and the fp32 masters on the host, each parameter
//! stepped there as its gradient is final. On the CPU host and device are one memory, so these
//! tests stage on it anyway (`stage_on_host_resident_devices`): the same copies and steps,
//! nothing saved; what they check is that the run trains the ordinary step's weights bit for
//! bit, where each thing lives, snapshots, and the error where offload saves nothing.

use crate::common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::tensor::DType;
use common::{devices, param_bits, watchdog};
use memsave_next::checkpoint::set_with_cp;
use memsave_next::fp16::Precision;
use memsave_next::hooks::{GradClip, Groups, OptimizerHook, SnapshotHook};
use memsave_next::offload::{
    optimizer_offload_stats, reset_optimizer_offload_stats, stage_on_host_resident_devices,
    OptimizerOffloadStats,
};
use memsave_next::scaler::{LossScaler, ScaleMode};
use memsave_next::train::{Hook, RunLength, Runner, TrainState};
use memsave_next::weights16::{WeightRounding, Weights16};

use common::blocks::NARROW;

use super::in_backward::{
    adamw, assert_same_runs, clipped_groups, momentum, run_hooked, Data, Net, Ran, Setup,
};

/// What the device held at the end of each iteration: the trainable parameters of
/// `TrainState::model` in fp32, and whether a forward copy was kept beside it.
#[derive(Clone, Default)]
struct Held(std::sync::Arc<std::sync::Mutex<Vec<(usize, bool)>>>);

impl Hook<Net> for Held {
    fn name(&self) -> &'static str {
        "held"
    }

    fn after_iter(&mut self, state: &mut TrainState<Net>) -> memsave_next::Result<()> {
        struct Fp32(usize);
        impl ModuleVisitor for Fp32 {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let value = param.val();
                if value.is_require_grad() && value.dtype() == DType::F32 {
                    self.0 += 1;
                }
            }
        }
        let mut fp32 = Fp32(0);
        state.model.visit(&mut fp32);
        self.0
            .lock()
            .unwrap()
            .push((fp32.0, state.forward_model.is_some()));
        Ok(())
    }
}

/// What the second run of [`ordinary_and_offloaded`] did and held.
struct Offloaded {
    ran: Ran,
    held: Vec<(usize, bool)>,
    stats: OptimizerOffloadStats,
}

/// `setup` trained with the ordinary step after backward, and with optimizer offload staged on
/// the CPU: the same weights, logs and warnings.
fn ordinary_and_offloaded(name: &str, setup: &Setup) -> (Ran, Offloaded) {
    reset_optimizer_offload_stats();
    let ordinary = run_hooked(setup, (setup.hook)(), None);
    assert_eq!(optimizer_offload_stats(), OptimizerOffloadStats::default());
    let hook = (setup.hook)().with_optimizer_offload(true);
    assert!(hook.optimizer_offload() && hook.step_in_backward());
    let held = Held::default();
    let before = stage_on_host_resident_devices(true);
    let offloaded = run_hooked(setup, hook, Some(Box::new(held.clone())));
    stage_on_host_resident_devices(before);
    let stats = optimizer_offload_stats();
    assert_same_runs(name, &ordinary, &offloaded);
    let held = held.0.lock().unwrap().clone();
    println!("{name}: {stats:?}");
    (
        ordinary,
        Offloaded {
            ran: offloaded,
            held,
            stats,
        },
    )
}

/// How many parameters of `setup`'s net step, and their elements (every trainable one but the
/// spare layer's weight and bias, 4 x 4 and 4).
fn stepped(setup: &Setup) -> (u64, u64) {
    struct Count(u64, u64);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0 += 1;
                self.1 += value.shape().num_elements() as u64;
            }
        }
    }
    let mut count = Count(0, 0);
    Net::new(&setup.device, setup.count).visit(&mut count);
    (count.0 - 2, count.1 - 20)
}

/// The groups that stepped.
fn steps(ran: &Ran) -> u64 {
    ran.logs.iter().filter(|log| log.stepped).count() as u64
}

fn f16_scaler() -> LossScaler {
    LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 2).unwrap()
}

#[test]
fn offload_in_fp32_trains_the_ordinary_steps_weights_in_one_pass_and_in_two() {
    watchdog(300, || {
        let setup = Setup {
            device: devices()[0].1.clone(),
            count: 3,
            checkpointed: false,
            data: Data {
                rows: 16,
                count: 4,
                loud: vec![],
            },
            iters: 4,
            optimizer: momentum,
            hook: OptimizerHook::new,
        };
        let (ordinary, off) = ordinary_and_offloaded("fp32, SGD with momentum, one pass", &setup);
        // The spare layer named once a step in both runs; the fp32 weights stay on the device
        // (the forward reads them), nothing beside them.
        assert_eq!(ordinary.warnings.len(), 4, "{:?}", ordinary.warnings);
        let trainable = off.held[0].0;
        assert!(off
            .held
            .iter()
            .all(|&(fp32, copy)| fp32 == trainable && !copy));
        // Each parameter that has a gradient stepped on the host once an iteration: its
        // gradient went down and its new weight came up, in fp32.
        let (params, elements) = stepped(&setup);
        assert_eq!(off.stats.host_steps, 4 * params);
        assert_eq!(off.stats.bytes_down, 4 * 4 * elements);
        assert_eq!(off.stats.bytes_up, 4 * 4 * elements);
        assert!(off.stats.host_seconds > 0.0);
        let setup = clipped_groups(devices()[1].1.clone());
        let (ordinary, off) = ordinary_and_offloaded(
            "fp32, AdamW clipped, groups of 3 over 7, checkpointed, Burn's Balanced strategy",
            &setup,
        );
        let stepped_at: Vec<bool> = ordinary.logs.iter().map(|log| log.stepped).collect();
        assert_eq!(stepped_at, [false, false, true, false, false, true, true]);
        assert!(ordinary
            .logs
            .iter()
            .filter_map(|log| log.grad_norm)
            .all(|norm| norm > 0.05));
        // Three steps; every micro-batch's gradients went down (summed on the host), and each
        // group's last twice (its norm pass, then its step pass).
        let (params, elements) = stepped(&setup);
        assert_eq!(off.stats.host_steps, 3 * params);
        assert_eq!(off.stats.bytes_down, (7 + 3) * 4 * elements);
        assert_eq!(off.stats.bytes_up, 3 * 4 * elements);
    });
}

#[test]
fn offload_in_mixed_precision_keeps_no_fp32_weight_on_the_device_and_trains_the_same_weights() {
    watchdog(300, || {
        let setup = Setup {
            device: devices()[0].1.clone(),
            count: 2,
            checkpointed: true,
            data: Data {
                rows: 16,
                count: 6,
                loud: vec![2],
            },
            iters: 6,
            optimizer: adamw,
            hook: || {
                OptimizerHook::new()
                    .with_mixed_precision(f16_scaler(), Precision::F16)
                    .with_grad_clip(Some(GradClip::new(1.0, 2.0).unwrap()))
                    .with_groups(Groups::new(2).unwrap())
            },
        };
        let (ordinary, off) = ordinary_and_offloaded(
            "f16, a dynamic scale, an overflow at iteration 2, clipped, groups of 2",
            &setup,
        );
        let (offloaded, held) = (&off.ran, &off.held);
        let scales: Vec<Option<f64>> = ordinary.logs.iter().map(|log| log.loss_scale).collect();
        assert!(
            ordinary.logs[3].overflow && !ordinary.logs[3].stepped,
            "{scales:?}"
        );
        assert!(offloaded
            .warnings
            .iter()
            .any(|w| w.contains("iteration 3: gradient overflow")));
        // During the run the device's model is the half copy: of its trainable parameters only
        // the fp32 island's two (the BatchNorm's) are fp32, and no other copy is kept.
        assert!(held.iter().all(|&held| held == (2, false)), "{held:?}");
        // After it the model is fp32 again (the weights compared above are fp32 bits). The
        // groups that did not overflow stepped each parameter on the host once.
        assert_eq!(steps(&ordinary), 2);
        let (params, elements) = stepped(&setup);
        let island = 2 * NARROW as u64;
        assert_eq!(off.stats.host_steps, 2 * params);
        // Each new weight went up in the type the device holds it in: f16, the island's fp32.
        assert_eq!(
            off.stats.bytes_up,
            2 * (2 * (elements - island) + 4 * island)
        );
    });
}

/// 16-bit weights: each goes to the host for its step (where its optimizer state lives) and
/// comes back; what lives where is checked by the counts (on the CPU a tensor's place cannot
/// be read).
#[test]
fn offload_of_bf16_weights_steps_each_on_the_host_and_trains_the_same_weights() {
    watchdog(300, || {
        let setup = Setup {
            device: devices()[1].1.clone(),
            count: 2,
            checkpointed: false,
            data: Data {
                rows: 16,
                count: 5,
                loud: vec![],
            },
            iters: 5,
            optimizer: || {
                Weights16::new(AdamWConfig::new().build())
                    .with_rounding(WeightRounding::Kahan)
                    .into()
            },
            hook: || {
                OptimizerHook::new()
                    .with_weights16(Precision::Bf16)
                    .with_groups(Groups::new(2).unwrap())
            },
        };
        let (ordinary, off) = ordinary_and_offloaded("bf16 weights, Kahan, groups of 2", &setup);
        // The bf16 weights are their only copy: none fp32 but the island's; each stepped on the
        // host once a group, going down and up in bf16 (the island's two in fp32). The
        // gradients went down in the same types: every micro-batch's, and each group's last
        // twice (16-bit weights imply a loss scale: the overflow check's norm pass first).
        assert!(
            off.held.iter().all(|&held| held == (2, false)),
            "{:?}",
            off.held
        );
        assert_eq!(steps(&ordinary), 3);
        let (params, elements) = stepped(&setup);
        let island = 2 * NARROW as u64;
        let bytes = 2 * (elements - island) + 4 * island;
        assert_eq!(off.stats.host_steps, 3 * params);
        assert_eq!(off.stats.bytes_up, 3 * bytes);
        assert_eq!(off.stats.bytes_down, (5 + 3) * bytes + 3 * bytes);
    });
}

/// Ends the run with an error after iteration `at`.
struct FailAt(usize);

impl Hook<Net> for FailAt {
    fn name(&self) -> &'static str {
        "fail"
    }

    fn after_iter(&mut self, state: &mut TrainState<Net>) -> memsave_next::Result<()> {
        if state.iter == self.0 {
            return Err(memsave_next::Error::invalid("test", "stops here"));
        }
        Ok(())
    }
}

/// A mixed-precision run of 4 iterations writing a snapshot after each 2, in `dir`; resumed
/// from `resume` where given; ended by an error after iteration `fail` where given. The
/// weights it gives back.
fn snapshot_run(
    offload: bool,
    dir: &std::path::Path,
    resume: Option<&std::path::Path>,
    fail: Option<usize>,
) -> Vec<Vec<u32>> {
    let device = devices()[0].1.clone();
    device.seed(7);
    let net = set_with_cp(Net::new(&device, 2), true);
    let hook = OptimizerHook::new()
        .with_mixed_precision(f16_scaler(), Precision::F16)
        .with_step_in_backward(true)
        .with_optimizer_offload(offload);
    let data = Data {
        rows: 8,
        count: 4,
        loud: vec![],
    };
    let mut runner = Runner::new(
        net,
        adamw(),
        Box::new(hook),
        data,
        RunLength::Iters(4),
        dir,
        device,
    )
    .unwrap();
    runner.set_lr(0.01).unwrap();
    runner.register_hook(Box::new(SnapshotHook::new(2, false)));
    if let Some(at) = fail {
        runner.register_hook(Box::new(FailAt(at)));
    }
    if let Some(path) = resume {
        runner.resume(path).unwrap();
    }
    let before = stage_on_host_resident_devices(true);
    let outcome = runner.run();
    stage_on_host_resident_devices(before);
    assert_eq!(outcome.is_err(), fail.is_some(), "{outcome:?}");
    param_bits(&runner.into_model())
}

#[test]
fn a_snapshot_written_with_offload_holds_the_masters_and_resumes_without_it_and_back() {
    watchdog(300, || {
        let root =
            std::env::temp_dir().join(format!("memsave-next-offload-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let reference = snapshot_run(false, &root.join("plain"), None, None);
        let offloaded = snapshot_run(true, &root.join("offloaded"), None, None);
        assert!(reference == offloaded, "offload trained other weights");
        // Its snapshot after iteration 2 holds the fp32 masters (not the device's half weights,
        // from which the resumed masters would start rounded) and the optimizer's state (on
        // the host): a run without offload resumes from it to the same weights, and a run with
        // offload from the ordinary run's snapshot.
        let without = snapshot_run(
            false,
            &root.join("without"),
            Some(&root.join("offloaded").join("iter_2.ckpt")),
            None,
        );
        assert!(
            reference == without,
            "resumed without offload: other weights"
        );
        let with = snapshot_run(
            true,
            &root.join("with"),
            Some(&root.join("plain").join("iter_2.ckpt")),
            None,
        );
        assert!(reference == with, "resumed with offload: other weights");
        // A run that ends with an error gives back the fp32 weights it had, as without offload
        // (not the device's half copy).
        let failed = snapshot_run(false, &root.join("failed"), None, Some(2));
        let failed_offloaded = snapshot_run(true, &root.join("failed-off"), None, Some(2));
        assert!(
            failed == failed_offloaded,
            "a failed offloaded run gave other weights"
        );
        assert!(failed != reference);
        let _ = std::fs::remove_dir_all(&root);
    });
}

/// On the CPU host and device are one memory: a run asked for offload says so once, naming
/// the key, and steps as without it (0.21 did the same), so a config that offloads on a GPU
/// still trains on the CPU.
#[test]
fn offload_where_host_and_device_are_one_memory_warns_once_and_steps_as_without() {
    watchdog(120, || {
        let setup = Setup {
            device: devices()[0].1.clone(),
            count: 2,
            checkpointed: false,
            data: Data {
                rows: 8,
                count: 2,
                loud: vec![],
            },
            iters: 2,
            optimizer: momentum,
            hook: OptimizerHook::new,
        };
        let ordinary = run_hooked(&setup, OptimizerHook::new(), None);
        reset_optimizer_offload_stats();
        let asked = run_hooked(
            &setup,
            OptimizerHook::new().with_optimizer_offload(true),
            None,
        );
        assert!(ordinary.weights == asked.weights);
        let said: Vec<&String> = asked
            .warnings
            .iter()
            .filter(|w| w.contains("`offload.optimizer`") && w.contains("saves nothing"))
            .collect();
        assert_eq!(said.len(), 1, "{:?}", asked.warnings);
        assert_eq!(optimizer_offload_stats().host_steps, 0);
    });
}
