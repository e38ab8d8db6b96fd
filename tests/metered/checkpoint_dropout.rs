//! Dropout inside a checkpointed segment: the recomputation reuses the first forward's masks, so
//! gradients equal the non-checkpointed run with the same seed, and the global random stream is
//! drawn from exactly as often. The test takes the binary's turn: Flex's random stream is
//! process-wide.

use crate::common;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::PaddingConfig2d;
use burn::prelude::*;
use burn::tensor::Distribution;
use common::{assert_same_grads, param_grads, values, watchdog, Materialise, AB};
use memsave::checkpoint::{recomputations, set_with_cp};
use memsave::nn::{Dropout, DropoutConfig};
use memsave::with_cp;

#[memsave::model]
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    conv1: Conv2d<B>,
    dropout: Dropout,
    conv2: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv2
            .forward(self.dropout.forward(self.conv1.forward(x)))
    }
}

fn run(
    model: &Block<AB>,
    x: &Tensor<AB, 4>,
    seed: u64,
) -> (burn::backend::autodiff::grads::Gradients, Vec<f32>) {
    let device = Default::default();
    AB::seed(&device, seed);
    let grads = model.forward(x.clone()).sum().backward();
    memsave::checkpoint::join_helpers().unwrap();
    // The next draw of the global stream after the step.
    let next = values(Tensor::<AB, 1>::random([4], Distribution::Default, &device).inner());
    (grads, next)
}

#[test]
fn recomputation_reuses_the_masks_and_leaves_the_random_stream_alone() {
    let _turn = crate::TURN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    watchdog(60, || {
        let device = Default::default();
        let conv = |c: [usize; 2]| {
            Conv2dConfig::new(c, [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init::<AB>(&device)
        };
        let plain = Block {
            conv1: conv([3, 8]),
            dropout: DropoutConfig::new(0.5).init(),
            conv2: conv([8, 3]),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = Tensor::<AB, 4>::random([2, 3, 6, 6], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();

        let (g_plain, next_plain) = run(&plain, &x, 7);
        let (g_cp, next_cp) = run(&checkpointed, &x, 7);
        assert_eq!(recomputations(), 1);
        let worst = assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
        let dx = common::max_relative_difference(
            &values(x.grad(&g_cp).unwrap()),
            &values(x.grad(&g_plain).unwrap()),
        );
        assert!(dx <= 1e-6, "input gradient: {dx}");
        assert_eq!(next_cp, next_plain, "the random stream moved differently");
        eprintln!("dropout: max relative difference {:e}", worst.max(dx));

        // The masks matter: another seed gives other gradients.
        let (g_other, _) = run(&plain, &x, 8);
        let a = values(plain.conv1.weight.grad(&g_other).unwrap());
        let b = values(plain.conv1.weight.grad(&g_plain).unwrap());
        assert!(common::max_relative_difference(&a, &b) > 1e-3);
    });
}
