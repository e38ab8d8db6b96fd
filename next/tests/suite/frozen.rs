//! Frozen weights held compressed on Burn 0.22 (`memsave_next::frozen`,
//! `OptimizerHook::with_frozen_dtype`): int8 through Burn's own quantization, which Burn's own
//! layers read, trains the weights of the fp32 run whose frozen weights were their int8 values
//! already, bit for bit, checkpointed or not; the bytes drop to about a third; bf16 under a
//! bf16 forward trains as without; a resumed run continues bit for bit; and the combinations
//! Burn 0.22 cannot run are errors naming the key.

use crate::common;

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, SgdConfig};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use common::blocks::{blocks, Block, NARROW};
use common::{bits, devices, initialized, watchdog};
use memsave_macros::model;
use memsave_next::checkpoint::set_with_cp;
use memsave_next::fp16::Precision;
use memsave_next::frozen::{compress_frozen, int8_scheme, FrozenDtype};
use memsave_next::hooks::{OptimizerHook, SnapshotHook};
use memsave_next::memory;
use memsave_next::scaler::LossScaler;
use memsave_next::train::{DataSource, RunLength, Runner, TrainModel};

#[model]
#[derive(Module, Debug)]
struct Net {
    #[with_cp]
    blocks: Vec<Block>,
    head: Linear,
}

impl TrainModel for Net {
    type Batch = Tensor<2>;

    fn loss(&self, x: Tensor<2>) -> Tensor<1> {
        let x = x.cast(self.head.weight.val().dtype());
        let y = self.blocks.iter().fold(x, |x, block| block.forward(x));
        self.head.forward(y).cast(DType::F32).powi_scalar(2).mean()
    }
}

/// Three blocks and a head, the first block frozen (`no_grad`: its two weights of rank 2 are
/// the frozen weights; its biases stay as they are).
fn net(device: &Device) -> Net {
    device.seed(3);
    let mut blocks = blocks(device, 3);
    blocks[0] = blocks[0].clone().no_grad();
    initialized(Net {
        blocks,
        head: LinearConfig::new(NARROW, 4).init(device),
    })
}

/// The frozen weights replaced by their int8 values, dequantized to fp32 (what the int8 run's
/// layers read).
fn rounded(net: Net) -> Net {
    struct Round;
    impl ModuleMapper for Round {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let frozen = D >= 2 && !param.val().is_require_grad();
            if !frozen {
                return param;
            }
            param.map(|tensor| tensor.quantize_dynamic(&int8_scheme()).dequantize())
        }
    }
    net.map(&mut Round)
}

struct Data;

impl DataSource<Tensor<2>> for Data {
    fn batches_per_epoch(&self) -> usize {
        3
    }

    fn batch(
        &self,
        epoch: usize,
        index: usize,
        device: &Device,
    ) -> memsave_next::Result<Tensor<2>> {
        device.seed(50 + (epoch * 3 + index) as u64);
        Ok(Tensor::<2>::random([24, NARROW], Distribution::Default, device).require_grad())
    }
}

fn runner(net: Net, hook: OptimizerHook, device: &Device, name: &str) -> Runner<Net, Data> {
    let dir =
        std::env::temp_dir().join(format!("memsave-next-frozen-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut runner = Runner::new(
        net,
        AdamWConfig::new().init(),
        Box::new(hook),
        Data,
        RunLength::Epochs(2),
        dir,
        device.clone(),
    )
    .unwrap();
    runner.set_lr(0.01).unwrap();
    runner
}

fn trained(net: Net, hook: OptimizerHook, device: &Device) -> Net {
    let mut runner = runner(net, hook, device, "run");
    runner.run().unwrap();
    runner.into_model()
}

/// Every float parameter's value as bits (a quantized one dequantized), in visiting order.
fn param_bits<M: Module>(module: &M) -> Vec<Vec<u32>> {
    struct Values(Vec<Vec<u32>>);
    impl burn::module::ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(bits(param.val().dequantize()));
        }
    }
    let mut values = Values(Vec::new());
    module.visit(&mut values);
    values.0
}

/// The same bits, or the first parameter (in visiting order) that differs.
fn same(a: &[Vec<u32>], b: &[Vec<u32>], name: &str) {
    assert_eq!(a.len(), b.len(), "{name}: parameters");
    for (index, (a, b)) in a.iter().zip(b).enumerate() {
        let differ = a.iter().zip(b).filter(|(a, b)| a != b).count();
        assert!(
            differ == 0 && a.len() == b.len(),
            "{name}: parameter {index} differs in {differ} of {} values",
            a.len()
        );
    }
}

/// The trainable weights (the frozen block's aside), as bits.
fn trainable_bits(net: &Net) -> Vec<Vec<u32>> {
    let mut bits = param_bits(&net.blocks[1]);
    bits.extend(param_bits(&net.blocks[2]));
    bits.extend(param_bits(&net.head));
    bits
}

#[test]
fn int8_frozen_weights_train_as_their_int8_values_in_fp32_checkpointed_or_not() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            let int8 = |checkpointed: bool| {
                let hook = OptimizerHook::new().with_frozen_dtype(Some(FrozenDtype::Int8));
                assert_eq!(hook.frozen_dtype(), Some(FrozenDtype::Int8));
                trained(set_with_cp(net(&device), checkpointed), hook, &device)
            };
            let (plain, checkpointed) = (int8(false), int8(true));
            // The frozen weights are held as int8, a constant of each segment.
            assert!(
                matches!(
                    checkpointed.blocks[0].up.weight.val().dtype(),
                    DType::QFloat(_)
                ),
                "{strategy}"
            );
            same(&param_bits(&checkpointed), &param_bits(&plain), strategy);
            // The fp32 run whose frozen weights were their int8 values already: the same
            // weights, bit for bit.
            let reference = trained(rounded(net(&device)), OptimizerHook::new(), &device);
            same(
                &trainable_bits(&plain),
                &trainable_bits(&reference),
                strategy,
            );
            let gap = largest_gap(&trainable(&plain), &trainable(&reference));
            // The values are read: the fp32 frozen weights train others, further off.
            let fp32 = trained(net(&device), OptimizerHook::new(), &device);
            let off = largest_gap(&trainable(&plain), &trainable(&fp32));
            println!("{strategy}: int8 against its values in fp32 {gap:e}, against fp32 {off:e}");
            assert!(off > 1e-3, "{strategy}: {off}");
        }
    });
}

/// The trainable weights (the frozen block's aside), as values.
fn trainable(net: &Net) -> Vec<f32> {
    trainable_bits(net)
        .into_iter()
        .flatten()
        .map(f32::from_bits)
        .collect()
}

/// The largest difference between two lists of weights.
fn largest_gap(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn int8_holds_the_frozen_weights_in_about_a_third_of_the_bytes() {
    watchdog(60, || {
        let device = devices()[0].1.clone();
        let meter = memory::meter_for(&device).unwrap();
        let model = net(&device);
        let before = meter.live();
        let (model, figures) = compress_frozen(model, FrozenDtype::Int8);
        let after = meter.live();
        let freed = before.saturating_sub(after);
        println!(
            "{} frozen weights: {} bytes held, {} before; the allocator freed {freed}",
            figures.count, figures.held_bytes, figures.before_bytes
        );
        assert_eq!(figures.count, 2);
        assert_eq!(figures.before_bytes, 2 * 64 * 512 * 4);
        let share = figures.held_bytes as f64 / figures.before_bytes as f64;
        assert!(share < 0.26, "{share}");
        // As the allocator counts them.
        let measured = figures.before_bytes.saturating_sub(freed);
        println!(
            "held as the allocator counts: {measured} bytes ({:.3} of fp32)",
            measured as f64 / figures.before_bytes as f64
        );
        assert!(measured * 100 < figures.before_bytes * 35, "{measured}");
        drop(model);
    });
}

#[test]
fn bf16_frozen_weights_under_a_bf16_forward_train_as_without() {
    watchdog(120, || {
        let device = devices()[0].1.clone();
        let hook = || {
            OptimizerHook::new()
                .with_mixed_precision(LossScaler::fixed(1.0).unwrap(), Precision::Bf16)
        };
        let plain = trained(net(&device), hook(), &device);
        let frozen = trained(
            net(&device),
            hook().with_frozen_dtype(Some(FrozenDtype::Bf16)),
            &device,
        );
        assert_eq!(frozen.blocks[0].up.weight.val().dtype(), DType::BF16);
        assert_eq!(plain.blocks[0].up.weight.val().dtype(), DType::F32);
        same(&trainable_bits(&plain), &trainable_bits(&frozen), "bf16");
    });
}

#[test]
fn a_run_with_int8_frozen_weights_resumes_bit_for_bit() {
    watchdog(120, || {
        let device = devices()[0].1.clone();
        let hook = || OptimizerHook::new().with_frozen_dtype(Some(FrozenDtype::Int8));
        let whole = trained(net(&device), hook(), &device);
        let mut first = runner(net(&device), hook(), &device, "resume");
        first.register_hook(Box::new(SnapshotHook::new(1, true)));
        first.run().unwrap();
        let snapshot = first.state().work_dir.join("epoch_1.ckpt");
        assert!(snapshot.exists());
        let mut resumed = runner(net(&device), hook(), &device, "resumed");
        resumed.resume(&snapshot).unwrap();
        resumed.run().unwrap();
        same(
            &param_bits(&resumed.into_model()),
            &param_bits(&whole),
            "resumed",
        );
    });
}

#[test]
fn what_burn_0_22_cannot_run_is_an_error_naming_the_key() {
    watchdog(60, || {
        let device = devices()[0].1.clone();
        let cases = [
            (
                OptimizerHook::new()
                    .with_mixed_precision(LossScaler::fixed(512.0).unwrap(), Precision::F16)
                    .with_frozen_dtype(Some(FrozenDtype::Int8)),
                "fp32 forward",
            ),
            (
                OptimizerHook::new().with_frozen_dtype(Some(FrozenDtype::Bf16)),
                "half forward",
            ),
        ];
        for (hook, says) in cases {
            let mut runner = runner(net(&device), hook, &device, "errors");
            let error = runner.run().unwrap_err().to_string();
            assert!(
                error.contains("optimizer.frozen_dtype") && error.contains(says),
                "{error}"
            );
        }
        // Nothing frozen: said, and the run goes on.
        let mut model = net(&device);
        model.blocks[0] = blocks(&device, 1).remove(0);
        let mut runner = Runner::new(
            initialized(model),
            SgdConfig::new().init(),
            Box::new(OptimizerHook::new().with_frozen_dtype(Some(FrozenDtype::Int8))),
            Data,
            RunLength::Iters(1),
            std::env::temp_dir().join("memsave-next-frozen-none"),
            device.clone(),
        )
        .unwrap();
        runner.set_lr(0.01).unwrap();
        runner.run().unwrap();
        assert!(
            runner
                .state()
                .warnings()
                .iter()
                .any(|w| w.contains("no frozen weight")),
            "{:?}",
            runner.state().warnings()
        );
    });
}
