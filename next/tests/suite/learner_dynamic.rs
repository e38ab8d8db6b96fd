//! `"dynamic"` in burn-train 0.22's Learner (`Memsave::dynamic`): a memory budget kept in every
//! micro-batch's step, the batches of two sizes, and the weights the plain Learner trains, bit
//! for bit.

use crate::common;

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::prelude::*;
use burn::train::{InferenceStep, RegressionOutput, SupervisedTraining};
use common::blocks::{blocks, Block, NARROW};
use common::{param_bits, watchdog};
use memsave_macros::model;
use memsave_next::burn_train::{ForwardStep, Memsave};
use memsave_next::planner::Budget;

#[model]
#[derive(Module, Debug)]
struct Net {
    input: Linear,
    #[with_cp]
    blocks: Vec<Block>,
}

impl Net {
    /// Initialized at once from seed 5 (Burn initializes a parameter at its first use, from
    /// the stream of that moment).
    fn new(device: &Device) -> Self {
        device.seed(5);
        common::initialized(Net {
            input: LinearConfig::new(NARROW, NARROW).init(device),
            blocks: blocks(device, 6),
        })
    }

    fn regression(&self, batch: Batch) -> RegressionOutput {
        let x = self.input.forward(batch.x);
        let output = self.blocks.iter().fold(x, |x, block| block.forward(x));
        let loss = (output.clone() - batch.y.clone()).powi_scalar(2).mean();
        RegressionOutput {
            loss,
            output,
            targets: batch.y,
        }
    }
}

impl ForwardStep for Net {
    type Input = Batch;
    type Output = RegressionOutput;

    fn forward_step(&self, batch: Batch) -> RegressionOutput {
        self.regression(batch)
    }
}

impl InferenceStep for Net {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> RegressionOutput {
        self.regression(batch)
    }
}

#[derive(Clone, Debug)]
struct Item {
    x: Vec<f32>,
}

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<2>,
}

#[derive(Clone)]
struct ItemBatcher;

impl Batcher<Item, Batch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let rows = items.len();
        let x: Vec<f32> = items.iter().flat_map(|item| item.x.clone()).collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [rows, NARROW]), device);
        Batch {
            y: x.clone().mul_scalar(0.5),
            x,
        }
    }
}

/// `n` items of a fixed pattern (no random stream).
fn items(n: usize) -> Vec<Item> {
    (0..n)
        .map(|row| Item {
            x: (0..NARROW)
                .map(|j| ((row * NARROW + j) * 37 % 29) as f32 / 29.0 - 0.5)
                .collect(),
        })
        .collect()
}

fn loader(items: Vec<Item>, batch: usize) -> Arc<dyn DataLoader<Batch>> {
    DataLoaderBuilder::new(ItemBatcher)
        .batch_size(batch)
        .set_device(common::device())
        .build(InMemDataset::new(items))
}

fn dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "memsave-next-learner-dynamic-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Two epochs of 640 items in batches of 256 (256, 256, 128 each epoch): plainly (no block
/// checkpointed), or under `"dynamic"` at `budget`.
fn train(budget: Option<Budget>, name: &str) -> (Net, Memsave) {
    let device = common::device();
    let model = Net::new(&device);
    let memsave = Memsave::new();
    let (memsave, learner) = match budget {
        Some(budget) => {
            let memsave = memsave.dynamic(budget, &device).unwrap();
            let learner = memsave
                .dynamic_learner(model, SgdConfig::new().init(), 0.01)
                .unwrap();
            (memsave, learner)
        }
        None => {
            let learner = memsave
                .learner(model, SgdConfig::new().init(), 0.01)
                .unwrap();
            (memsave, learner)
        }
    };
    device.seed(9);
    let result = SupervisedTraining::new(dir(name), loader(items(640), 256), loader(items(8), 8))
        .with_interrupter(memsave.interrupter())
        .num_epochs(2)
        .launch(learner);
    assert!(
        result.error.is_none(),
        "{:?}",
        result.error.map(|e| e.to_string())
    );
    memsave.finish().unwrap();
    (result.model.into_model(), memsave)
}

#[test]
fn the_learner_keeps_a_dynamic_budget_at_both_batch_sizes_and_trains_as_plain() {
    watchdog(300, || {
        let (plain, _) = train(None, "plain");
        let (dynamic, memsave) = train(Some(Budget::Fraction(0.8)), "dynamic");
        let figures = memsave.dynamic_figures().unwrap();
        println!("{figures:?}");
        assert_eq!(figures.steps, 5, "every micro-batch after the profile");
        assert!(
            figures.highest_peak <= figures.budget,
            "a step peaked at {} over the budget {}",
            figures.highest_peak,
            figures.budget
        );
        assert!(figures.kept > 0 && figures.recomputed > 0, "{figures:?}");
        assert_eq!(figures.by_size.len(), 2, "{figures:?}");
        assert_eq!(
            param_bits(&plain),
            param_bits(&dynamic),
            "weights after 6 steps"
        );
    });
}

#[test]
fn dynamic_needs_its_own_learner() {
    // Under the watchdog: one test at a time (a model seeds Flex's one random generator).
    watchdog(120, || {
        let device = common::device();
        let memsave = Memsave::new()
            .dynamic(Budget::Fraction(0.8), &device)
            .unwrap();
        let error = match memsave.learner(Net::new(&device), SgdConfig::new().init(), 0.01) {
            Ok(_) => panic!("a plain learner under \"dynamic\""),
            Err(error) => error.to_string(),
        };
        assert!(error.contains("Memsave::dynamic_learner"), "{error}");
    });
}
