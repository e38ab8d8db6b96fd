//! `#[with_cp]`: gradients with checkpointing equal those without, on a residual block, a stack
//! of 8, an FPN-like graph with shared outputs, nested segments, with fp16, and the failure
//! modes (a panic in a segment, an unused parameter, many segments). Every test that could hang
//! runs under a watchdog.

use crate::common;

use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::interpolate::{Interpolate2d, Interpolate2dConfig, InterpolateMode};
use burn::nn::{PaddingConfig2d, Relu};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use common::{assert_same_grads, param_grads, watchdog, Materialise, AB};
use memsave::checkpoint::{recomputations, set_with_cp};
use memsave::fp16::{wrap_fp16_model, Fp16, Precision};
use memsave::nn::{BatchNorm, BatchNormConfig};
use memsave::{auto_fp16, with_cp};

/// conv-BN-ReLU-conv-BN + skip, then ReLU outside the segment (MMCV's Bottleneck layout).
#[memsave::model]
#[derive(Module, Debug)]
pub struct Residual<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    relu: Relu,
    with_cp: bool,
    fp16_enabled: Fp16,
}

fn conv<B: Backend>(channels: [usize; 2], device: &B::Device) -> Conv2d<B> {
    Conv2dConfig::new(channels, [3, 3])
        .with_padding(PaddingConfig2d::Same)
        .init(device)
}

impl<B: Backend> Residual<B> {
    pub fn new(channels: usize, device: &B::Device) -> Self {
        Residual {
            conv1: conv([channels, channels], device),
            bn1: BatchNormConfig::new(channels).init(device),
            conv2: conv([channels, channels], device),
            bn2: BatchNormConfig::new(channels).init(device),
            relu: Relu::new(),
            with_cp: false,
            fp16_enabled: Fp16::Off,
        }
    }
}

impl<B: memsave::Backend> Residual<B> {
    /// `[N, C, H, W]` -> `[N, C, H, W]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.relu.forward(self.residual(x))
    }

    #[with_cp]
    #[auto_fp16]
    fn residual(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let y = self
            .relu
            .forward(self.bn1.forward(self.conv1.forward(x.clone())));
        self.bn2.forward(self.conv2.forward(y)) + x
    }
}

/// A stem, then a stack of residual blocks; `#[with_cp]` marks the stack.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Stack<B: Backend> {
    stem: Conv2d<B>,
    #[with_cp]
    blocks: Vec<Residual<B>>,
    fp16_enabled: Fp16,
}

impl<B: Backend> Stack<B> {
    pub fn new(depth: usize, device: &B::Device) -> Self {
        Stack {
            stem: conv([3, 4], device),
            blocks: (0..depth).map(|_| Residual::new(4, device)).collect(),
            fp16_enabled: Fp16::Off,
        }
    }
}

impl<B: memsave::Backend> Stack<B> {
    #[auto_fp16]
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = self.stem.forward(images);
        for block in &self.blocks {
            x = block.forward(x);
        }
        x
    }
}

fn images(batch: usize) -> Tensor<AB, 4> {
    Tensor::random(
        [batch, 3, 6, 6],
        Distribution::Normal(0.0, 1.0),
        &Default::default(),
    )
}

/// Fixed weights for the loss, so that gradients are not all alike.
fn loss_weights(shape: [usize; 4]) -> Tensor<AB, 4> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

#[test]
fn residual_block_input_and_parameter_gradients_equal() {
    let worst = watchdog(60, || {
        let device = Default::default();
        let plain = Residual::<AB>::new(4, &device).map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        assert!(checkpointed.with_cp && !plain.with_cp);
        let x = Tensor::<AB, 4>::random([2, 4, 5, 5], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let w = loss_weights([2, 4, 5, 5]);

        let g_plain = (plain.forward(x.clone()) * w.clone()).sum().backward();
        assert_eq!(recomputations(), 0);
        let g_cp = (checkpointed.forward(x.clone()) * w).sum().backward();
        assert_eq!(recomputations(), 1, "the block was recomputed once");
        memsave::checkpoint::join_helpers().unwrap();

        let dx_plain = common::values(x.grad(&g_plain).unwrap());
        let dx_cp = common::values(x.grad(&g_cp).unwrap());
        let dx = common::max_relative_difference(&dx_cp, &dx_plain);
        assert!(dx <= 1e-6, "input gradient: {dx}");
        let params = assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
        dx.max(params)
    });
    eprintln!("residual block: max relative difference {worst:e}");
}

#[test]
fn stack_of_eight_gradients_equal() {
    let worst = watchdog(120, || {
        let plain = Stack::<AB>::new(8, &Default::default()).map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        assert!(checkpointed.blocks.iter().all(|block| block.with_cp));
        let x = images(2);
        let w = loss_weights([2, 4, 6, 6]);
        let g_plain = (plain.forward(x.clone()) * w.clone()).sum().backward();
        assert_eq!(recomputations(), 0);
        let g_cp = (checkpointed.forward(x) * w).sum().backward();
        assert_eq!(recomputations(), 8, "each of the 8 blocks was recomputed");
        memsave::checkpoint::join_helpers().unwrap();
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        )
    });
    eprintln!("stack of 8: max relative difference {worst:e}");
}

#[test]
fn batch_norm_statistics_are_updated_once() {
    watchdog(60, || {
        let device = Default::default();
        let plain = Stack::<AB>::new(2, &device).map(&mut Materialise);
        // A second model with the same weights but running statistics of its own (a clone
        // would share them).
        let copy = Stack::<AB>::new(2, &device).load_record(plain.clone().into_record());
        let checkpointed = set_with_cp(copy, true);
        let x = images(4);
        // Reading the statistics between forward and backward (as a logger would) settles the
        // forward's update before the recomputation runs: a second update would show.
        let loss_plain = plain.forward(x.clone()).sum();
        let loss_cp = checkpointed.forward(x).sum();
        let _ = plain.blocks[0].bn1.running_mean.value_sync();
        let _ = checkpointed.blocks[0].bn1.running_mean.value_sync();
        let _ = loss_plain.backward();
        let _ = loss_cp.backward();
        assert_eq!(recomputations(), 2, "both blocks were recomputed");
        memsave::checkpoint::join_helpers().unwrap();
        // `valid()` settles the updates of every thread (the recomputation runs on another).
        use burn::module::AutodiffModule;
        let (plain_settled, cp_settled) = (plain.valid(), checkpointed.valid());
        for (p, c) in plain_settled.blocks.iter().zip(&cp_settled.blocks) {
            for (a, b) in [(&p.bn1, &c.bn1), (&p.bn2, &c.bn2)] {
                let (mean_p, mean_c) = (a.running_mean.value(), b.running_mean.value());
                let (var_p, var_c) = (a.running_var.value(), b.running_var.value());
                assert_eq!(common::values(mean_p), common::values(mean_c));
                assert_eq!(common::values(var_p), common::values(var_c));
            }
        }
        // They did move, and independently: the plain model's statistics took one update, the
        // checkpointed model's one more (a second step), so now they must differ.
        let mean = common::values(checkpointed.blocks[0].bn1.running_mean.value_sync().inner());
        assert!(mean.iter().any(|v| *v != 0.0));
        let _ = checkpointed.forward(images(4)).sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        let again = common::values(checkpointed.blocks[0].bn1.running_mean.value_sync().inner());
        let plain_mean = common::values(plain.blocks[0].bn1.running_mean.value_sync().inner());
        assert_ne!(again, plain_mean, "the two models share their statistics");
    });
}

/// FPN-like: a segment with two inputs and two outputs; one output feeds two consumers, and the
/// segment's input is also used outside the segment.
#[memsave::model]
#[derive(Module, Debug)]
pub struct TopDown<B: Backend> {
    lateral3: Conv2d<B>,
    lateral4: Conv2d<B>,
    upsample: Interpolate2d,
    with_cp: bool,
}

impl<B: Backend> TopDown<B> {
    fn new(device: &B::Device) -> Self {
        TopDown {
            lateral3: conv([4, 4], device),
            lateral4: conv([4, 4], device),
            upsample: Interpolate2dConfig::new()
                .with_scale_factor(Some([2.0, 2.0]))
                .with_mode(InterpolateMode::Nearest)
                .init(),
            with_cp: false,
        }
    }
}

impl<B: memsave::Backend> TopDown<B> {
    /// `c3 [N, C, 2H, 2W]`, `c4 [N, C, H, W]` -> `(p3, p4)` of the same shapes.
    #[with_cp]
    fn forward(&self, c3: Tensor<B, 4>, c4: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let p4 = self.lateral4.forward(c4);
        let p3 = self.lateral3.forward(c3) + self.upsample.forward(p4.clone());
        (p3, p4)
    }
}

#[test]
fn fpn_like_graph_with_shared_outputs_gradients_equal() {
    let worst = watchdog(60, || {
        let device = Default::default();
        let plain = TopDown::<AB>::new(&device).map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let c3 = Tensor::<AB, 4>::random([2, 4, 8, 8], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let c4 = Tensor::<AB, 4>::random([2, 4, 4, 4], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let (w3, w4) = (loss_weights([2, 4, 8, 8]), loss_weights([2, 4, 4, 4]));
        let loss = |model: &TopDown<AB>| {
            let (p3, p4) = model.forward(c3.clone(), c4.clone());
            // p4 has two consumers; c4 is also used outside the segment.
            (p3 * w3.clone()).sum()
                + (p4.clone() * w4.clone()).sum()
                + p4.powf_scalar(2.0).sum()
                + (c4.clone() * w4.clone()).sum()
        };
        let g_plain = loss(&plain).backward();
        let g_cp = loss(&checkpointed).backward();
        assert_eq!(recomputations(), 1);
        memsave::checkpoint::join_helpers().unwrap();
        let mut worst = 0.0_f32;
        for input in [&c3, &c4] {
            let a = common::values(input.grad(&g_cp).unwrap());
            let b = common::values(input.grad(&g_plain).unwrap());
            worst = worst.max(common::max_relative_difference(&a, &b));
        }
        assert!(worst <= 1e-6, "input gradients: {worst}");
        worst.max(assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        ))
    });
    eprintln!("FPN-like graph: max relative difference {worst:e}");
}

#[test]
fn with_auto_fp16_half_activations_inside_the_segment() {
    let worst = watchdog(120, || {
        let model = Stack::<AB>::new(3, &Default::default()).map(&mut Materialise);
        let plain = wrap_fp16_model(model, Precision::F16);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = images(2);
        let out = checkpointed.forward(x.clone());
        assert_eq!(
            out.dtype(),
            DType::F16,
            "activations stay half through the segments"
        );
        let w = loss_weights([2, 4, 6, 6]);
        let g_plain = (plain.forward(x).cast(DType::F32) * w.clone())
            .sum()
            .backward();
        let g_cp = (out.cast(DType::F32) * w).sum().backward();
        assert_eq!(recomputations(), 3);
        memsave::checkpoint::join_helpers().unwrap();
        let grads = param_grads(&checkpointed, &g_cp);
        assert!(!grads.is_empty());
        assert_same_grads(&grads, &param_grads(&plain, &g_plain), 1e-6)
    });
    eprintln!("fp16 + checkpointing: max relative difference {worst:e}");
}

/// A block whose checkpointed body calls another checkpointed block.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Outer<B: Backend> {
    inner: Residual<B>,
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Outer<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(self.inner.forward(x))
    }
}

#[test]
fn nested_checkpoints_work() {
    watchdog(60, || {
        let device = Default::default();
        let inner = Residual::<AB>::new(4, &device);
        let plain = Outer {
            inner,
            conv: conv([4, 4], &device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let mut nested = plain.clone();
        nested.with_cp = true;
        nested.inner.with_cp = true;
        let x = Tensor::<AB, 4>::random([2, 4, 5, 5], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let w = loss_weights([2, 4, 5, 5]);
        let g_plain = (plain.forward(x.clone()) * w.clone()).sum().backward();
        let g_nested = (nested.forward(x.clone()) * w).sum().backward();
        // The outer segment here; the inner one on the outer's recompute thread.
        assert_eq!(recomputations(), 1);
        memsave::checkpoint::join_helpers().unwrap();
        assert_same_grads(
            &param_grads(&nested, &g_nested),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
        let a = common::values(x.grad(&g_nested).unwrap());
        let b = common::values(x.grad(&g_plain).unwrap());
        assert!(common::max_relative_difference(&a, &b) <= 1e-6);
    });
}

#[test]
fn many_segments() {
    watchdog(120, || {
        let plain = Stack::<AB>::new(48, &Default::default()).map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = images(1);
        let g_plain = plain.forward(x.clone()).sum().backward();
        let g_cp = checkpointed.forward(x).sum().backward();
        assert_eq!(recomputations(), 48);
        memsave::checkpoint::join_helpers().unwrap();
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
    });
}

/// A segment with a parameter it never uses.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Unused<B: Backend> {
    used: Conv2d<B>,
    unused: Param<Tensor<B, 1>>,
    with_cp: bool,
}

impl<B: memsave::Backend> Unused<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.used.forward(x)
    }
}

#[test]
fn an_unused_parameter_gets_no_gradient_as_without_checkpointing_and_nothing_hangs() {
    watchdog(60, || {
        let device = Default::default();
        let model = Unused::<AB> {
            used: conv([4, 4], &device),
            unused: Param::from_tensor(Tensor::ones([3], &device)),
            with_cp: true,
        };
        let x = Tensor::<AB, 4>::random([1, 4, 3, 3], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let grads = model.forward(x.clone()).sum().backward();
        assert_eq!(recomputations(), 1);
        memsave::checkpoint::join_helpers().unwrap();
        assert!(model.unused.grad(&grads).is_none());
        assert!(model.used.weight.grad(&grads).is_some());
        assert!(x.grad(&grads).is_some());

        let mut plain = model.clone();
        plain.with_cp = false;
        let grads = plain.forward(x).sum().backward();
        assert!(
            plain.unused.grad(&grads).is_none(),
            "Burn gives it none either"
        );
    });
}

/// A segment that panics when it is recomputed (its second run).
#[memsave::model]
#[derive(Module, Debug)]
pub struct Fragile<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl<B: memsave::Backend> Fragile<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        if RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            panic!("boom in the recomputation");
        }
        self.conv.forward(x)
    }
}

#[test]
fn a_panic_while_recomputing_reaches_backward_without_a_hang() {
    let message = watchdog(60, || {
        let device = Default::default();
        let model = Fragile::<AB> {
            conv: conv([4, 4], &device),
            with_cp: true,
        };
        let x = Tensor::<AB, 4>::random([1, 4, 3, 3], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let loss = model.forward(x).sum();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loss.backward()));
        memsave::checkpoint::join_helpers().unwrap();
        let Err(payload) = outcome else {
            panic!("the backward pass must fail")
        };
        payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default()
    });
    assert!(
        message.contains("panicked while it was recomputed") && message.contains("boom"),
        "{message}"
    );
}

/// A segment over a `Vec` of many inputs (no limit on their number).
#[memsave::model]
#[derive(Module, Debug)]
pub struct Merge<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Merge<B> {
    #[with_cp]
    fn forward(&self, maps: Vec<Tensor<B, 4>>) -> Tensor<B, 4> {
        let sum = maps
            .into_iter()
            .enumerate()
            .map(|(i, m)| m * (i as f64 + 1.0))
            .reduce(|a, b| a + b)
            .expect("maps");
        self.conv.forward(sum)
    }
}

#[test]
fn twenty_inputs_in_a_vec() {
    watchdog(60, || {
        let device = Default::default();
        let plain = Merge::<AB> {
            conv: conv([4, 4], &device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let maps: Vec<Tensor<AB, 4>> = (0..20)
            .map(|_| {
                Tensor::random([1, 4, 3, 3], Distribution::Normal(0.0, 1.0), &device).require_grad()
            })
            .collect();
        let g_plain = plain.forward(maps.clone()).sum().backward();
        let g_cp = checkpointed.forward(maps.clone()).sum().backward();
        assert_eq!(recomputations(), 1);
        memsave::checkpoint::join_helpers().unwrap();
        for map in &maps {
            let a = common::values(map.grad(&g_cp).unwrap());
            let b = common::values(map.grad(&g_plain).unwrap());
            assert!(common::max_relative_difference(&a, &b) <= 1e-6);
        }
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
    });
}
