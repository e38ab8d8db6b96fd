//! `with_cp = "dynamic"`: a budget kept in every step at every input size, with the weights,
//! BatchNorm statistics and the rest bit-identical to the plain run's.

use crate::common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use memsave::hooks::OptimizerHook;
use memsave::models::classifier::ClassificationBatch;
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::models::registry::BACKBONE_KEYS;
use memsave::nn::{BatchNorm, BatchNormConfig, Dropout, DropoutConfig};
use memsave::planner::dynamic::IntervalFigures;
use memsave::planner::{Budget, DynamicHook};
use memsave::train::{DataSource, OptimizerKind, RunLength, Runner, TrainModel};
use memsave::with_cp;

type B = Autodiff<Flex>;

/// The peaks read the process's counting allocator: these tests take turns.
use crate::TURN;

/// Two convolutions, BatchNorm and memsave's dropout, around a residual: activations many
/// times the weights, as a detector's at full size.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    a: Conv2d<B>,
    bn: BatchNorm<B>,
    b: Conv2d<B>,
    dropout: Dropout,
    with_cp: bool,
}

impl<B: Backend> Block<B> {
    fn new(channels: usize, dropout: f64, device: &B::Device) -> Self {
        let conv = || {
            Conv2dConfig::new([channels, channels], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        };
        Block {
            a: conv(),
            bn: BatchNormConfig::new(channels).init(device),
            b: conv(),
            dropout: DropoutConfig::new(dropout).init(),
            with_cp: false,
        }
    }
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let y = burn::tensor::activation::relu(self.bn.forward(self.a.forward(x.clone())));
        self.dropout
            .forward(burn::tensor::activation::gelu(self.b.forward(y)))
            + x
    }
}

#[memsave::model]
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    stem: Conv2d<B>,
    #[with_cp]
    blocks: Vec<Block<B>>,
    head: Linear<B>,
}

impl<B: Backend> Net<B> {
    fn new(device: &B::Device) -> Self {
        Self::with_dropout(0.1, device)
    }

    fn with_dropout(dropout: f64, device: &B::Device) -> Self {
        Net {
            stem: Conv2dConfig::new([3, 16], [3, 3])
                .with_stride([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            blocks: (0..6).map(|_| Block::new(16, dropout, device)).collect(),
            head: LinearConfig::new(16, 4).init(device),
        }
    }
}

impl<B: AutodiffBackend + memsave::Backend> TrainModel<B> for Net<B> {
    type Batch = ClassificationBatch<B>;

    fn loss(&self, batch: Self::Batch) -> Tensor<B, 1> {
        let mut x = self.stem.forward(batch.images);
        for block in &self.blocks {
            x = block.forward(x);
        }
        let logits = self.head.forward(x.mean_dim(3).mean_dim(2).flatten(1, 3));
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.labels)
    }
}

/// Batches of images of several sizes, one size a batch, in turn (multi-scale training).
struct Sizes(Vec<SyntheticClassification<B>>);

impl DataSource<B, ClassificationBatch<B>> for Sizes {
    fn batches_per_epoch(&self) -> usize {
        self.0[0].batches_per_epoch()
    }

    fn batch(
        &self,
        epoch: usize,
        index: usize,
        device: &burn::backend::flex::FlexDevice,
    ) -> memsave::Result<ClassificationBatch<B>> {
        self.0[index % self.0.len()].batch(epoch, index, device)
    }
}

/// Every float the model holds (weights and running statistics), flattened.
fn everything(model: &Net<B>) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = param.val().cast(DType::F32).into_data();
            self.0.extend(values.to_vec::<f32>().unwrap());
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// Trains [`Net`] for `iters` steps on images of `sizes` pixels in turn, plainly or
/// under "dynamic" at `budget`: the model, and the hook's figures.
fn train(
    sizes: &[usize],
    iters: usize,
    budget: Option<Budget>,
    name: &str,
) -> (Net<B>, Option<IntervalFigures>) {
    let device = Default::default();
    // One seed for both runs' weights and the dropout masks.
    <B as Backend>::seed(&device, 7);
    let model = Net::<B>::new(&device);
    let model = memsave::checkpoint::set_with_cp(model, budget.is_some());
    let data = Sizes(
        sizes
            .iter()
            .map(|&size| {
                SyntheticClassification::<B>::new(
                    SyntheticClassificationConfig::new(4, 32, size),
                    4,
                    device,
                )
                .unwrap()
            })
            .collect(),
    );
    let work_dir = common::fresh_dir("dynamic", name);
    let mut runner = Runner::new(
        model,
        &OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 1e-4,
            nesterov: false,
        },
        Box::new(OptimizerHook::new()),
        data,
        RunLength::Iters(iters),
        &work_dir,
        device,
    )
    .unwrap();
    runner.set_lr(0.01).unwrap();
    let figures = budget.map(|budget| {
        let hook = DynamicHook::new(budget, BACKBONE_KEYS, &device)
            .unwrap()
            .with_log_interval(2);
        let figures = hook.figures();
        runner.register_hook(Box::new(hook));
        figures
    });
    runner.run().unwrap();
    let figures = figures.map(|f| f.borrow().clone());
    (runner.into_model(), figures)
}

#[test]
fn dynamic_keeps_the_budget_at_every_input_size_and_trains_as_the_plain_step() {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    common::watchdog(600, || {
        // Profiled at 96; then 64, 80 and 96 in turn.
        let sizes = [96, 64, 80];
        let iters = 7;
        let (plain, _) = train(&sizes, iters, None, "plain");
        let before = memsave::checkpoint::recomputations();
        let (dynamic, figures) = train(&sizes, iters, Some(Budget::Fraction(0.7)), "dynamic");
        let recomputed = memsave::checkpoint::recomputations() - before;
        let figures = figures.unwrap();
        // What it chose ran: the profile's six recomputations, and those it chose after.
        assert_eq!(recomputed, 6 + figures.recomputed as u64, "{figures:?}");
        eprintln!("{figures:?}");
        assert_eq!(figures.steps, iters - 1, "every step after the profile");
        assert!(figures.budget > 0);
        assert!(
            figures.highest_peak <= figures.budget,
            "a step peaked at {} over the budget {}",
            figures.highest_peak,
            figures.budget
        );
        // It chose: some segments kept, some recomputed, and not alike at every size.
        assert!(figures.kept > 0 && figures.recomputed > 0, "{figures:?}");
        let per_size: Vec<f64> = figures
            .by_size
            .values()
            .map(|(_, kept, recomputed)| *kept as f64 / (kept + recomputed) as f64)
            .collect();
        assert_eq!(per_size.len(), 3, "{figures:?}");
        assert!(
            per_size.iter().any(|share| *share != per_size[0]),
            "the same choice at every size: {figures:?}"
        );
        // Exact: every weight and running statistic bit-identical to the plain run's.
        let (a, b) = (everything(&plain), everything(&dynamic));
        assert_eq!(a.len(), b.len());
        let differing = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differing, 0, "{differing} of {} values differ", a.len());
    })
}

/// A model of its own holding `values` (as [`everything`] lists them): a clone would share
/// its BatchNorm statistics with the original.
fn copy_of(values: &[f32], device: &burn::backend::flex::FlexDevice) -> Net<B> {
    struct Load<'a>(&'a [f32], usize);
    impl burn::module::ModuleMapper<B> for Load<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let values = self.0;
            let offset = &mut self.1;
            param.map(|tensor| {
                let shape = tensor.shape();
                let n = shape.num_elements();
                let data =
                    burn::tensor::TensorData::new(values[*offset..*offset + n].to_vec(), shape);
                *offset += n;
                let copy = Tensor::<B, D>::from_data(data, &tensor.device());
                if tensor.is_require_grad() {
                    copy.require_grad()
                } else {
                    copy
                }
            })
        }
    }
    let mut load = Load(values, 0);
    let model = Net::<B>::with_dropout(0.0, device).map(&mut load);
    assert_eq!(load.1, values.len());
    model
}

/// Two data-parallel peers in this process, each from `start` on its half of the batches,
/// plainly or under "dynamic" at `budget` each: per peer, its final model, the peak its own
/// meter read, and the hook's figures.
fn two_peers(
    start: &[f32],
    budget: Option<Budget>,
    name: &str,
) -> Vec<(Vec<f32>, u64, Option<IntervalFigures>)> {
    use memsave::parallel::{Collective, ZeroStage};
    let dir = common::fresh_dir("dynamic", name);
    common::dp::peers(2, |peer| {
        let device: burn::backend::flex::FlexDevice = Default::default();
        let mut config = SyntheticClassificationConfig::new(4, 32, 96);
        config.seed = 5;
        let data = SyntheticClassification::<B>::new(config, 4, device)?.with_shard(peer.shard());
        let model = copy_of(start, &device);
        let model = memsave::checkpoint::set_with_cp(model, budget.is_some());
        let mut runner = common::dp::peer_runner_with(
            model,
            &common::dp::sgd(),
            ZeroStage::Off,
            OptimizerHook::new(),
            data,
            RunLength::Iters(5),
            &dir.join(format!("{}", peer.rank())),
            peer,
        );
        let figures = budget.map(|budget| {
            let hook = DynamicHook::new(budget, BACKBONE_KEYS, &device).unwrap();
            let figures = hook.figures();
            runner.register_hook(Box::new(hook));
            figures
        });
        // This peer's bytes: its training thread's and its helpers'.
        let meter = memsave::memory::peer_meter_for(&device).unwrap();
        meter.reset_peak();
        runner.run()?;
        let peak = meter.peak();
        let figures = figures.map(|f| f.borrow().clone());
        Ok((everything(&runner.into_model()), peak, figures))
    })
    .unwrap()
}

#[test]
fn data_parallel_peers_in_one_process_keep_a_budget_each_and_train_as_plain_peers() {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let _peers = common::dp::turn();
    common::watchdog(600, || {
        let device = Default::default();
        <B as Backend>::seed(&device, 7);
        // No dropout: the peers' threads would draw from one stream in no fixed order.
        let start = everything(&Net::<B>::with_dropout(0.0, &device));
        let process = memsave::memory::reset_peak();
        let plain = two_peers(&start, None, "peers-plain");
        let process = memsave::memory::peak_bytes() - process;
        let peaks: Vec<u64> = plain.iter().map(|(_, peak, _)| *peak).collect();
        eprintln!("plain peers' own peaks {peaks:?}, the process's rise {process}");
        // Each peer's meter reads its own bytes, not the process's: both peers' together are
        // more than either's.
        assert!(peaks
            .iter()
            .all(|&peak| peak > 0 && (peak as usize) < process));
        // A budget in bytes under each peer's plain peak, above its half: a meter that read
        // both peers' bytes would find the weights and the batch of two over it.
        let budget = peaks.iter().min().unwrap() * 4 / 5;
        let dynamic = two_peers(&start, Some(Budget::Bytes(budget)), "peers-dynamic");
        for (rank, ((plain, _, _), (dynamic, _, figures))) in plain.iter().zip(&dynamic).enumerate()
        {
            let figures = figures.as_ref().unwrap();
            eprintln!("peer {rank}: {figures:?}");
            assert_eq!(figures.steps, 4, "every step after the profile");
            assert!(
                figures.highest_peak <= budget,
                "peer {rank} peaked at {} over its budget {budget}",
                figures.highest_peak
            );
            assert!(figures.recomputed > 0, "{figures:?}");
            // Exact: each peer's weights and statistics bit-identical to the plain peer's.
            let differing = plain
                .iter()
                .zip(dynamic)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(
                differing,
                0,
                "peer {rank}: {differing} of {} differ",
                plain.len()
            );
        }
    })
}
