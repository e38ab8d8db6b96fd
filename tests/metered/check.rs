//! `memsave::check`: the one-call check a user runs on their own model. It materialises the
//! lazy weights and reseeds before each pass itself, so a fresh model with dropout passes; a
//! segment that cannot be checkpointed is named; half precision is compared too. One test at a
//! time: the counting allocator and the random stream are process-wide.

use crate::common;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use common::{watchdog, AB};
use memsave::check::{check_model, ModelCheck};
use memsave::fp16::{Fp16, Precision};
use memsave::nn::{Dropout, DropoutConfig};
use memsave::with_cp;

/// The check's memory figures are the process's counting allocator's: one test at a time.
use crate::TURN as SERIAL;

#[memsave::model]
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    up: Linear<B>,
    dropout: Dropout,
    down: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = burn::tensor::activation::gelu(self.up.forward(x.clone()));
        x + self.down.forward(self.dropout.forward(h))
    }
}

/// A block that reads a tracked tensor from a bare field: it cannot be recomputed from fresh
/// leaves, so memsave runs it plainly.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Captures<B: Backend> {
    up: Linear<B>,
    bias: Tensor<B, 2>,
    with_cp: bool,
}

impl<B: memsave::Backend> Captures<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.up.forward(x) + self.bias.clone()
    }
}

#[memsave::model]
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    stem: Linear<B>,
    #[with_cp]
    blocks: Vec<Block<B>>,
    head: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> Net<B> {
    fn new(width: usize, depth: usize, device: &B::Device) -> Self {
        let block = || Block {
            up: LinearConfig::new(width, 4 * width).init(device),
            dropout: DropoutConfig::new(0.3).init(),
            down: LinearConfig::new(4 * width, width).init(device),
            with_cp: false,
        };
        Net {
            stem: LinearConfig::new(16, width).init(device),
            blocks: (0..depth).map(|_| block()).collect(),
            head: LinearConfig::new(width, 1).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    #[memsave::auto_fp16(apply_to = (x))]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut x = self.stem.forward(x);
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.head.forward(x)
    }

    #[memsave::force_fp32(args = (y))]
    fn loss(&self, y: Tensor<B, 2>) -> Tensor<B, 1> {
        y.powi_scalar(2).mean()
    }
}

fn input() -> Tensor<AB, 2> {
    AB::seed(&Default::default(), 1);
    Tensor::random(
        [64, 16],
        Distribution::Normal(0.0, 1.0),
        &Default::default(),
    )
}

#[test]
fn a_fresh_model_with_dropout_checks_bit_identical_and_each_segment_saves_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    watchdog(120, || {
        let x = input();
        // Fresh: Burn's weights are lazy, so clones of it would differ without the check's
        // materialisation.
        let model = Net::<AB>::new(64, 3, &Default::default());
        let report = check_model(model, |m: &Net<AB>| m.loss(m.forward(x.clone()))).unwrap();
        println!("{report}");
        assert_eq!(report.worst_difference(), 0.0, "{report}");
        assert_eq!(report.passes.len(), 2);
        let plain = report.pass("fp32 plain").unwrap();
        let checkpointed = report.pass("fp32 checkpointed").unwrap();
        assert_eq!(plain.loss, checkpointed.loss);
        assert!(
            checkpointed.kept_bytes.unwrap() < plain.kept_bytes.unwrap(),
            "{report}"
        );
        assert_eq!(report.segments.len(), 3, "{report}");
        for segment in &report.segments {
            assert!(segment.checkpointed, "{report}");
            assert_eq!(segment.recomputed, 1, "{report}");
            // Each block keeps its input and hidden layers plainly: 64 x 256 fp32 at least.
            assert!(segment.saved().unwrap() >= 64 * 256 * 4, "{report}");
        }
        assert_eq!(report.segments[1].path, "blocks.1");
        assert!(report.to_string().contains("recomputed 1x"));

        // The seed is read: another seed draws other masks, so another loss.
        let model = Net::<AB>::new(64, 3, &Default::default());
        let other = ModelCheck {
            seed: 7,
            ..ModelCheck::default()
        }
        .run(model, |m: &Net<AB>| m.loss(m.forward(x.clone())))
        .unwrap();
        assert_ne!(other.passes[0].loss, plain.loss);
        assert_eq!(other.worst_difference(), 0.0);
    });
}

#[test]
fn half_precision_is_compared_with_fp32_and_with_itself() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    watchdog(120, || {
        let x = input();
        let model = Net::<AB>::new(32, 2, &Default::default());
        let report = ModelCheck::default()
            .with_precision(Precision::F16)
            .run_with_fp16(model, |m: &Net<AB>| m.loss(m.forward(x.clone())))
            .unwrap();
        println!("{report}");
        let names: Vec<_> = report.passes.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "fp32 plain",
                "fp32 checkpointed",
                "f16 plain",
                "f16 checkpointed"
            ]
        );
        assert_eq!(report.worst_difference(), 0.0, "{report}");
        let half = report.pass("f16 plain").unwrap();
        assert_eq!(half.against, "fp32 plain");
        assert!(
            half.difference > 0.0 && half.difference < 5e-2,
            "f16 rounding, not a bug: {report}"
        );
        // Asking for half precision through `run` (no Fp16Module bound) is an error naming it.
        let model = Net::<AB>::new(32, 2, &Default::default());
        let error = ModelCheck::default()
            .with_precision(Precision::F16)
            .run(model, |m: &Net<AB>| m.loss(m.forward(x.clone())))
            .unwrap_err()
            .to_string();
        assert!(error.contains("run_with_fp16"), "{error}");
    });
}

#[test]
fn a_segment_that_cannot_be_recomputed_is_named() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    watchdog(120, || {
        let device = Default::default();
        let x = input();
        let stem = LinearConfig::new(16, 8).init::<AB>(&device);
        // The bias is tracked: an output of another layer, as a user's code might keep one.
        let bias = stem.forward(Tensor::ones([1, 16], &device));
        let model = Captures {
            up: LinearConfig::new(16, 8).init(&device),
            bias,
            with_cp: false,
        };
        let x = x.require_grad();
        let report = check_model(model, |m: &Captures<AB>| {
            m.forward(x.clone()).powi_scalar(2).mean()
        })
        .unwrap();
        println!("{report}");
        assert_eq!(report.segments.len(), 1, "{report}");
        assert!(!report.segments[0].checkpointed, "{report}");
        let why = report.segments[0].why_plain.as_deref().unwrap();
        assert!(why.contains("bare `Tensor` field"), "{report}");
        assert!(report.to_string().contains("ran plainly"), "{report}");
        assert_eq!(report.worst_difference(), 0.0);
        // A loss of more than one value is an error naming the loss.
        let model = Net::<AB>::new(8, 1, &Default::default());
        let error = check_model(model, |m: &Net<AB>| m.forward(x.clone()).flatten(0, 1))
            .unwrap_err()
            .to_string();
        assert!(error.contains("loss"), "{error}");
    });
}
