//! The checkpointing trap no compiler can catch: a block with a `with_cp` flag, switched on by its
//! parent's `#[with_cp]` field, whose forward is not marked `#[with_cp]`. It would train
//! without checkpointing, silently. The first step names it: memsave's runner ends with an error,
//! burn-train's adapter warns, `memsave::check` says why the segment ran plainly. A block whose
//! forward is marked, and a block switched off, are not reported.

mod common;

use std::sync::Mutex;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use common::{watchdog, AB};
use memsave::check::switched_on_without_segment;
use memsave::checkpoint::set_with_cp;
use memsave::hooks::{LrSchedule, LrUpdaterHook, OptimizerHook};
use memsave::models::classifier::ClassificationBatch;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::train::{OptimizerKind, RunLength, Runner, TrainModel};
use memsave::with_cp;

static SERIAL: Mutex<()> = Mutex::new(());

/// The trap: a flag, and a forward without `#[with_cp]`.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Unmarked<B: Backend> {
    linear: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Unmarked<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear.forward(x).tanh()
    }
}

/// The same block done right.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Marked<B: Backend> {
    linear: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Marked<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear.forward(x).tanh()
    }
}

#[memsave::model]
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    stem: Linear<B>,
    #[with_cp]
    marked: Vec<Marked<B>>,
    #[with_cp]
    unmarked: Vec<Unmarked<B>>,
    head: Linear<B>,
}

impl<B: memsave::Backend> Net<B> {
    fn new(device: &B::Device) -> Self {
        Net {
            stem: LinearConfig::new(3 * 8 * 8, 32).init(device),
            marked: vec![Marked {
                linear: LinearConfig::new(32, 32).init(device),
                with_cp: false,
            }],
            unmarked: vec![Unmarked {
                linear: LinearConfig::new(32, 32).init(device),
                with_cp: false,
            }],
            head: LinearConfig::new(32, 4).init(device),
        }
    }

    fn logits(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let mut x = self.stem.forward(images.flatten::<2>(1, 3));
        for block in &self.marked {
            x = block.forward(x);
        }
        for block in &self.unmarked {
            x = block.forward(x);
        }
        self.head.forward(x)
    }
}

impl<B: AutodiffBackend + memsave::Backend> TrainModel<B> for Net<B> {
    type Batch = ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        let logits = self.logits(batch.images);
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.labels)
    }
}

fn data() -> SyntheticClassification<AB> {
    SyntheticClassification::new(
        SyntheticClassificationConfig::new(4, 16, 8),
        4,
        Default::default(),
    )
    .unwrap()
}

fn run(model: Net<AB>, name: &str) -> memsave::Result<()> {
    let dir = std::env::temp_dir().join(format!("memsave-trap-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut runner = Runner::new(
        model,
        OptimizerKind::sgd(0.0),
        Box::new(OptimizerHook::new()),
        data(),
        RunLength::Iters(2),
        &dir,
        Default::default(),
    )?;
    runner.register_hook(Box::new(LrUpdaterHook {
        schedule: LrSchedule::constant(0.01),
    }));
    let result = runner.run();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[test]
fn a_block_switched_on_without_a_with_cp_method_ends_the_first_step_with_an_error_naming_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(120, || {
        let model = set_with_cp(Net::<AB>::new(&Default::default()), true);
        let error = run(model, "on")
            .expect_err("the trap trained silently")
            .to_string();
        assert!(error.contains("`Unmarked`"), "{error}");
        assert!(!error.contains("`Marked`"), "{error}");
        assert!(error.contains("#[with_cp]"), "{error}");
        assert!(error.contains("with_cp"), "{error}");
    });
}

#[test]
fn the_same_model_switched_off_trains() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(120, || {
        run(Net::<AB>::new(&Default::default()), "off").unwrap();
    });
}

#[test]
fn only_the_blocks_switched_on_are_named() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(120, || {
        let device = Default::default();
        let net = Net::<AB>::new(&device);
        // Only the marked blocks on: nothing to report once they ran.
        let mut net = Net {
            marked: set_with_cp(net.marked, true),
            ..net
        };
        let x = Tensor::<AB, 4>::ones([2, 3, 8, 8], &device).require_grad();
        let _ = net.logits(x.clone()).sum().backward();
        assert!(switched_on_without_segment(&net).is_empty());
        // The unmarked ones on too: they are named.
        net.unmarked = set_with_cp(net.unmarked, true);
        let _ = net.logits(x).sum().backward();
        assert_eq!(
            switched_on_without_segment(&net),
            vec!["Unmarked".to_string()]
        );
    });
}

#[test]
fn memsave_check_says_the_forward_is_not_marked_not_mmcvs_guard() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(120, || {
        let device = Default::default();
        let net = Net::<AB>::new(&device);
        let x = Tensor::<AB, 4>::ones([2, 3, 8, 8], &device);
        let report =
            memsave::check::check_model(net, move |net: &Net<AB>| net.logits(x.clone()).sum())
                .unwrap();
        println!("{report}");
        let unmarked = report
            .segments
            .iter()
            .find(|segment| segment.type_name == "Unmarked")
            .expect("the unmarked block is a segment");
        let why = unmarked.why_plain.as_deref().unwrap_or_default();
        assert!(why.contains("not marked `#[with_cp]`"), "{why}");
        assert!(!why.contains("guard"), "{why}");
        let marked = report
            .segments
            .iter()
            .find(|segment| segment.type_name == "Marked")
            .expect("the marked block is a segment");
        assert!(marked.checkpointed, "{marked:?}");
    });
}
