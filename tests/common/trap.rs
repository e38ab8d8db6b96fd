//! The checkpointing trap (tests/suite/with_cp_trap.rs, tests/suite/run_context/events.rs): a block with a `with_cp`
//! flag whose forward is not marked `#[with_cp]`, beside one done right, in a net whose
//! `#[with_cp]` fields switch both on.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use memsave::models::classifier::ClassificationBatch;
use memsave::train::TrainModel;
use memsave::with_cp;

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
    pub stem: Linear<B>,
    #[with_cp]
    pub marked: Vec<Marked<B>>,
    #[with_cp]
    pub unmarked: Vec<Unmarked<B>>,
    pub head: Linear<B>,
}

impl<B: memsave::Backend> Net<B> {
    pub fn new(device: &B::Device) -> Self {
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

    pub fn logits(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
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
