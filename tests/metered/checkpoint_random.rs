//! Burn's layers that draw from the backend's random stream (attention and feed-forward
//! dropout, a transformer encoder) inside `#[with_cp]` blocks: each step's gradients equal the
//! same step without checkpointing, nested or not, mixed with memsave's own dropout. Its tests
//! take the binary's turn: Flex's random stream is process-wide.

use crate::common;

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::transformer::{
    PositionWiseFeedForward, PositionWiseFeedForwardConfig, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use common::{assert_same_grads, param_grads, values, watchdog, Materialise, AB};
use memsave::checkpoint::{recomputations, set_with_cp, RandomDraws};
use memsave::nn::{Dropout, DropoutConfig};
use memsave::with_cp;

/// Burn's random stream (its `Dropout`'s masks) is the backend's, one per process: these tests
/// seed and draw from it one at a time.
use crate::TURN as ONE_AT_A_TIME;

fn sequence() -> Tensor<AB, 3> {
    let values: Vec<f32> = (0..2 * 6 * 16)
        .map(|i| ((i * 37 % 29) as f32 / 29.0 - 0.5) * 2.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [2, 6, 16]), &Default::default())
}

/// Attention and feed-forward with Burn's dropout (p = 0.3), and memsave's dropout between.
#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    attn: MultiHeadAttention<B>,
    drop: Dropout,
    mlp: PositionWiseFeedForward<B>,
    with_cp: bool,
}

impl<B: Backend> Block<B> {
    fn new(device: &B::Device) -> Self {
        Block {
            attn: MultiHeadAttentionConfig::new(16, 2)
                .with_dropout(0.3)
                .init(device),
            drop: DropoutConfig::new(0.3).init(),
            mlp: PositionWiseFeedForwardConfig::new(16, 32)
                .with_dropout(0.3)
                .init(device),
            with_cp: false,
        }
    }
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = x.clone() + self.attn.forward(MhaInput::self_attn(x)).context;
        let x = self.drop.forward(x);
        x.clone() + self.mlp.forward(x)
    }
}

/// A stage of blocks, itself checkpointed: segments nested in a segment.
#[memsave::model]
#[derive(Module, Debug)]
struct Stage<B: Backend> {
    proj: Linear<B>,
    #[with_cp]
    blocks: Vec<Block<B>>,
    with_cp: bool,
}

impl<B: memsave::Backend> Stage<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let mut x = self.proj.forward(x);
        for block in &self.blocks {
            x = block.forward(x);
        }
        x
    }
}

/// One step from `seed`: the parameter gradients and the input's.
fn step<M: Module<AB>>(
    model: &M,
    forward: impl Fn(&M, Tensor<AB, 3>) -> Tensor<AB, 3>,
    seed: u64,
) -> (
    std::collections::HashMap<burn::module::ParamId, Vec<f32>>,
    Vec<f32>,
) {
    AB::seed(&Default::default(), seed);
    let x = sequence().require_grad();
    let grads = forward(model, x.clone()).sum().backward();
    memsave::checkpoint::join_helpers().unwrap();
    (param_grads(model, &grads), values(x.grad(&grads).unwrap()))
}

#[test]
fn burn_dropout_in_a_segment_gives_the_gradients_of_the_step_without_checkpointing() {
    let _lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(120, || {
        let plain = Block::<AB>::new(&Default::default()).map(&mut Materialise);
        assert!(plain.draws_random());
        let checkpointed = set_with_cp(plain.clone(), true);
        let forward = |m: &Block<AB>, x| m.forward(x);

        let (g_plain, dx_plain) = step(&plain, forward, 11);
        let before = recomputations();
        let (g_cp, dx_cp) = step(&checkpointed, forward, 11);
        assert_eq!(recomputations() - before, 1);
        assert_same_grads(&g_cp, &g_plain, 0.0);
        assert_eq!(dx_cp, dx_plain);

        // The masks matter: another seed, other gradients.
        let (g_other, _) = step(&plain, forward, 12);
        let id = plain.attn.query.weight.id;
        assert_ne!(g_other[&id], g_plain[&id]);
    });
}

#[test]
fn nested_segments_with_burn_dropout_match_too() {
    let _lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(120, || {
        let device = Default::default();
        let plain = Stage::<AB> {
            proj: LinearConfig::new(16, 16).init(&device),
            blocks: vec![Block::new(&device), Block::new(&device)],
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let forward = |m: &Stage<AB>, x| m.forward(x);
        let (g_plain, dx_plain) = step(&plain, forward, 21);
        let before = recomputations();
        let (g_cp, dx_cp) = step(&checkpointed, forward, 21);
        // The stage, then its two blocks inside the stage's recomputation.
        assert_eq!(recomputations() - before, 1);
        assert_same_grads(&g_cp, &g_plain, 0.0);
        assert_eq!(dx_cp, dx_plain);
    });
}

/// Burn's whole transformer encoder (dropout inside every layer) as one checkpointed block.
#[memsave::model]
#[derive(Module, Debug)]
struct EncoderBlock<B: Backend> {
    encoder: TransformerEncoder<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> EncoderBlock<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 3>, mask: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        self.encoder
            .forward(TransformerEncoderInput::new(x).mask_pad(mask))
    }
}

#[test]
fn burn_transformer_encoder_in_a_segment_matches() {
    let _lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(120, || {
        let device = Default::default();
        let plain = EncoderBlock::<AB> {
            encoder: TransformerEncoderConfig::new(16, 32, 2, 2)
                .with_dropout(0.2)
                .init(&device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let mask = Tensor::<AB, 2, Bool>::from_data(
            [[false, false, false, false, true, true], [false; 6]],
            &device,
        );
        let forward = move |m: &EncoderBlock<AB>, x| m.forward(x, mask.clone());
        let (g_plain, dx_plain) = step(&plain, forward.clone(), 31);
        let (g_cp, dx_cp) = step(&checkpointed, forward, 31);
        assert_same_grads(&g_cp, &g_plain, 0.0);
        assert_eq!(dx_cp, dx_plain);
    });
}

/// Without dropout nothing draws: the segment leaves the global stream alone, as before.
#[test]
fn a_block_without_dropout_does_not_touch_the_random_stream() {
    let _lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    watchdog(60, || {
        let device = Default::default();
        let block = Block::<AB> {
            attn: MultiHeadAttentionConfig::new(16, 2)
                .with_dropout(0.0)
                .init(&device),
            drop: DropoutConfig::new(0.3).init(),
            mlp: PositionWiseFeedForwardConfig::new(16, 32)
                .with_dropout(0.0)
                .init(&device),
            with_cp: true,
        }
        .map(&mut Materialise);
        assert!(!block.draws_random());
        let next = |run: bool| {
            AB::seed(&device, 41);
            if run {
                let _ = block.forward(sequence().require_grad()).sum().backward();
                memsave::checkpoint::join_helpers().unwrap();
            } else {
                // memsave's dropout draws one mask, as in the step.
                let _ = Tensor::<AB, 3>::random(
                    [2, 6, 16],
                    burn::tensor::Distribution::Bernoulli(0.7),
                    &device,
                );
            }
            values(
                Tensor::<AB, 1>::random([4], burn::tensor::Distribution::Default, &device).inner(),
            )
        };
        assert_eq!(next(true), next(false));
    });
}
