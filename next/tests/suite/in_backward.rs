//! The step in backward on Burn 0.22 (`OptimizerHook::with_step_in_backward`): each parameter
//! steps as its gradient is final, and the run trains the weights of the step after backward,
//! bit for bit: in one pass (fp32), in two (clipping; mixed precision, an overflow skipped;
//! 16-bit weights), with accumulation, with every block checkpointed and dropout drawing
//! inside, with Burn's BatchNorm moving its running statistics once per step; and the step's
//! peak drops by about the gradients' size.

use crate::common;

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use common::blocks::{blocks, Block, NARROW};
use common::{devices, initialized, param_bits, watchdog};
use memsave_macros::model;
use memsave_next::checkpoint::set_with_cp;
use memsave_next::fp16::Precision;
use memsave_next::hooks::{GradClip, Groups, OptimizerHook};
use memsave_next::memory;
use memsave_next::scaler::{LossScaler, ScaleMode};
use memsave_next::train::{DataSource, Hook, IterLog, RunLength, Runner, TrainModel, TrainState};
use memsave_next::weights16::{WeightRounding, Weights16};

#[model]
#[derive(Module, Debug)]
pub(crate) struct Net {
    #[with_cp]
    pub(crate) blocks: Vec<Block>,
    #[fp16(fp32)]
    pub(crate) norm: BatchNorm,
    pub(crate) head: Linear,
    /// Never used in the loss: it gets no gradient and never steps.
    pub(crate) spare: Linear,
}

impl Net {
    pub(crate) fn new(device: &Device, count: usize) -> Self {
        initialized(Net {
            blocks: blocks(device, count),
            norm: BatchNormConfig::new(NARROW).init(device).into(),
            head: LinearConfig::new(NARROW, 4).init(device),
            spare: LinearConfig::new(4, 4).init(device),
        })
    }
}

impl TrainModel for Net {
    type Batch = Tensor<2>;

    fn loss(&self, x: Tensor<2>) -> Tensor<1> {
        // In the weights' type (16-bit weights, the half copy of mixed precision).
        let x = x.cast(self.head.weight.val().dtype());
        let y = self.blocks.iter().fold(x, |x, block| block.forward(x));
        let [rows, width] = y.dims();
        let y = self
            .norm
            .forward(y.reshape([rows, width, 1]))
            .reshape([rows, width]);
        self.head.forward(y).powi_scalar(2).mean()
    }
}

/// `count` batches of `rows` rows an epoch, each drawn from a seed of its own; batches listed
/// in `loud` 1e6 times larger (past f16's range: their f16 gradients overflow).
#[derive(Clone)]
pub(crate) struct Data {
    pub(crate) rows: usize,
    pub(crate) count: usize,
    pub(crate) loud: Vec<usize>,
}

impl DataSource<Tensor<2>> for Data {
    fn batches_per_epoch(&self) -> usize {
        self.count
    }

    fn batch(
        &self,
        epoch: usize,
        index: usize,
        device: &Device,
    ) -> memsave_next::Result<Tensor<2>> {
        let at = epoch * self.count + index;
        device.seed(1000 + at as u64);
        let x = Tensor::<2>::random([self.rows, NARROW], Distribution::Default, device);
        let scale = if self.loud.contains(&at) { 1e6 } else { 1.0 };
        // Tracked, so that the first block is checkpointed too (MMCV's guard).
        Ok(x.mul_scalar(scale).require_grad())
    }
}

/// Each iteration's log and the rise of its peak above the bytes live before it (as the
/// counting allocator reads them).
#[derive(Clone, Default)]
struct Probe(Arc<Mutex<Vec<(IterLog, u64)>>>, Arc<Mutex<u64>>);

impl Hook<Net> for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn before_iter(&mut self, state: &mut TrainState<Net>) -> memsave_next::Result<()> {
        *self.1.lock().unwrap() = memory::meter_for(&state.device).unwrap().reset_peak();
        Ok(())
    }

    fn after_iter(&mut self, state: &mut TrainState<Net>) -> memsave_next::Result<()> {
        let peak = memory::meter_for(&state.device).unwrap().peak();
        let rise = peak.saturating_sub(*self.1.lock().unwrap());
        self.0.lock().unwrap().push((state.log.clone(), rise));
        Ok(())
    }
}

/// What a run ends with: the weights, the running statistics (of `valid()`), every iteration's
/// log and peak, the warnings.
pub(crate) struct Ran {
    pub(crate) weights: Vec<Vec<u32>>,
    pub(crate) running: Vec<Vec<u32>>,
    pub(crate) logs: Vec<IterLog>,
    pub(crate) peaks: Vec<u64>,
    pub(crate) warnings: Vec<String>,
}

pub(crate) struct Setup {
    pub(crate) device: Device,
    pub(crate) count: usize,
    pub(crate) checkpointed: bool,
    pub(crate) data: Data,
    pub(crate) iters: usize,
    pub(crate) optimizer: fn() -> ModuleOptimizer,
    pub(crate) hook: fn() -> OptimizerHook,
}

fn run(setup: &Setup, in_backward: bool) -> Ran {
    let hook = (setup.hook)().with_step_in_backward(in_backward);
    assert_eq!(hook.step_in_backward(), in_backward);
    run_hooked(setup, hook, None)
}

/// A run of `setup` with `hook` (anomalous parameters reported) and another hook of the test's.
pub(crate) fn run_hooked(
    setup: &Setup,
    hook: OptimizerHook,
    extra: Option<Box<dyn Hook<Net>>>,
) -> Ran {
    setup.device.seed(7);
    let net = Net::new(&setup.device, setup.count);
    let net = set_with_cp(net, setup.checkpointed);
    let hook = hook.with_detect_anomalous_params(true);
    let dir = std::env::temp_dir().join(format!("memsave-next-in-backward-{}", std::process::id()));
    let mut runner = Runner::new(
        net,
        (setup.optimizer)(),
        Box::new(hook),
        setup.data.clone(),
        RunLength::Iters(setup.iters),
        dir,
        setup.device.clone(),
    )
    .unwrap();
    runner.set_lr(0.01).unwrap();
    let probe = Probe::default();
    runner.register_hook(Box::new(probe.clone()));
    if let Some(extra) = extra {
        runner.register_hook(extra);
    }
    runner.run().unwrap();
    let warnings = runner.state().warnings().to_vec();
    let net = runner.into_model();
    let (logs, peaks) = probe.0.lock().unwrap().drain(..).unzip();
    Ran {
        weights: param_bits(&net),
        running: param_bits(&net.valid().norm),
        logs,
        peaks,
        warnings,
    }
}

/// The step in backward against the step after it: the same weights, running statistics, loss
/// scales, overflows, norms and warnings.
fn same_run(name: &str, setup: Setup) -> (Ran, Ran) {
    let after = run(&setup, false);
    let during = run(&setup, true);
    assert_same_runs(name, &after, &during);
    (after, during)
}

/// Two runs trained the same weights and running statistics, with the same loss scales,
/// overflows, norms and warnings.
pub(crate) fn assert_same_runs(name: &str, after: &Ran, during: &Ran) {
    assert!(
        after.weights == during.weights,
        "{name}: the step in backward trained other weights"
    );
    assert!(
        after.running == during.running,
        "{name}: the running statistics moved otherwise"
    );
    for (iter, (a, d)) in after.logs.iter().zip(&during.logs).enumerate() {
        let bits = |value: Option<f64>| value.map(f64::to_bits);
        assert_eq!(
            bits(a.loss),
            bits(d.loss),
            "{name}: iteration {iter}'s loss"
        );
        assert_eq!(
            a.loss_scale, d.loss_scale,
            "{name}: iteration {iter}'s scale"
        );
        assert_eq!(
            a.overflow, d.overflow,
            "{name}: iteration {iter}'s overflow"
        );
        assert_eq!(a.stepped, d.stepped, "{name}: iteration {iter}'s step");
        assert_eq!(
            bits(a.grad_norm),
            bits(d.grad_norm),
            "{name}: iteration {iter}'s norm"
        );
    }
    assert_eq!(after.logs.len(), during.logs.len());
    assert_eq!(after.warnings, during.warnings, "{name}: the warnings");
}

/// AdamW clipped at a norm of 0.05, in groups of 3 over 7 micro-batches, every block
/// checkpointed: two passes at each group's end, sums between.
pub(crate) fn clipped_groups(device: Device) -> Setup {
    Setup {
        device,
        count: 3,
        checkpointed: true,
        data: Data {
            rows: 16,
            count: 7,
            loud: vec![],
        },
        iters: 7,
        optimizer: adamw,
        hook: || {
            OptimizerHook::new()
                .with_grad_clip(Some(GradClip::new(0.05, 2.0).unwrap()))
                .with_groups(Groups::new(3).unwrap())
        },
    }
}

pub(crate) fn momentum() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

pub(crate) fn adamw() -> ModuleOptimizer {
    AdamWConfig::new().init()
}

#[test]
fn one_pass_fp32_trains_the_same_weights_with_and_without_checkpointing() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            for checkpointed in [false, true] {
                let name = format!("{strategy}, checkpointed: {checkpointed}");
                let (after, _) = same_run(
                    &name,
                    Setup {
                        device: device.clone(),
                        count: 3,
                        checkpointed,
                        data: Data {
                            rows: 16,
                            count: 4,
                            loud: vec![],
                        },
                        iters: 4,
                        optimizer: momentum,
                        hook: OptimizerHook::new,
                    },
                );
                // The spare layer: named once a step, in both runs.
                assert_eq!(after.warnings.len(), 4, "{name}: {:?}", after.warnings);
                assert!(after.warnings[0].contains("spare.weight, spare.bias"));
                assert!(after.logs.iter().all(|log| log.grad_norm.is_some()));
            }
        }
    });
}

#[test]
fn two_passes_clip_and_accumulate_as_the_step_after_backward() {
    watchdog(300, || {
        let (after, _) = same_run(
            "clipped, groups of 3 over 7",
            clipped_groups(devices()[0].1.clone()),
        );
        let stepped: Vec<bool> = after.logs.iter().map(|log| log.stepped).collect();
        assert_eq!(stepped, [false, false, true, false, false, true, true]);
        // The clipping is read: every norm above 0.05.
        let norms: Vec<f64> = after.logs.iter().filter_map(|log| log.grad_norm).collect();
        assert_eq!(norms.len(), 3);
        assert!(norms.iter().all(|norm| *norm > 0.05), "{norms:?}");
    });
}

#[test]
fn two_passes_in_mixed_precision_skip_an_overflow_as_the_step_after_backward() {
    watchdog(300, || {
        let (after, during) = same_run(
            "f16, a dynamic scale, an overflow at iteration 2, clipped",
            Setup {
                device: devices()[1].1.clone(),
                count: 2,
                checkpointed: true,
                data: Data {
                    rows: 16,
                    count: 5,
                    loud: vec![2],
                },
                iters: 5,
                optimizer: adamw,
                hook: || {
                    let scaler = LossScaler::new(1024.0, ScaleMode::Dynamic, 2.0, 2).unwrap();
                    OptimizerHook::new()
                        .with_mixed_precision(scaler, Precision::F16)
                        .with_grad_clip(Some(GradClip::new(1.0, 2.0).unwrap()))
                },
            },
        );
        let scales: Vec<Option<f64>> = after.logs.iter().map(|log| log.loss_scale).collect();
        assert_eq!(
            scales,
            [
                Some(1024.0),
                Some(2048.0),
                Some(1024.0),
                Some(1024.0),
                Some(2048.0)
            ]
        );
        assert!(after.logs[2].overflow && !after.logs[2].stepped);
        assert!(during
            .warnings
            .iter()
            .any(|w| w.contains("iteration 2: gradient overflow")));
    });
}

#[test]
fn bf16_weights_step_in_backward_as_after_it() {
    watchdog(300, || {
        same_run(
            "bf16 weights, Kahan",
            Setup {
                device: devices()[0].1.clone(),
                count: 2,
                checkpointed: false,
                data: Data {
                    rows: 16,
                    count: 4,
                    loud: vec![],
                },
                iters: 4,
                optimizer: || {
                    Weights16::new(AdamWConfig::new().build())
                        .with_rounding(WeightRounding::Kahan)
                        .into()
                },
                hook: || OptimizerHook::new().with_weights16(Precision::Bf16),
            },
        );
    });
}

#[test]
fn the_step_peak_drops_by_about_the_gradients() {
    watchdog(300, || {
        let setup = Setup {
            device: devices()[0].1.clone(),
            count: 6,
            checkpointed: false,
            data: Data {
                rows: 4,
                count: 3,
                loud: vec![],
            },
            iters: 3,
            optimizer: momentum,
            hook: OptimizerHook::new,
        };
        let (after, during) = same_run("the peaks", setup);
        let gradients: u64 = {
            let net = Net::new(&devices()[0].1, 6);
            param_bits(&net).iter().map(|p| p.len() as u64 * 4).sum()
        };
        // The last step, once momentum's state exists: the peak's rise above the bytes live
        // before the iteration.
        let (plain, tapped) = (after.peaks[2], during.peaks[2]);
        println!(
            "step peak's rise: after backward {plain} bytes, in backward {tapped} bytes ({:.3}); the \
             gradients {gradients} bytes",
            tapped as f64 / plain as f64
        );
        assert!(
            tapped + gradients * 7 / 10 < plain,
            "in backward {tapped}, after {plain}, gradients {gradients}"
        );
    });
}

#[test]
fn a_device_without_autodiff_is_an_error_naming_the_setting() {
    watchdog(60, || {
        let device = Device::flex();
        let net = Net::new(&device, 1);
        let data = Data {
            rows: 4,
            count: 1,
            loud: vec![],
        };
        let hook = OptimizerHook::new().with_step_in_backward(true);
        let dir =
            std::env::temp_dir().join(format!("memsave-next-in-backward-e-{}", std::process::id()));
        let mut runner = Runner::new(
            net,
            momentum(),
            Box::new(hook),
            data,
            RunLength::Iters(1),
            dir,
            device,
        )
        .unwrap();
        runner.set_lr(0.01).unwrap();
        let error = runner.run().unwrap_err().to_string();
        assert!(
            error.contains("step_in_backward") && error.contains("device.autodiff()"),
            "{error}"
        );
    });
}
