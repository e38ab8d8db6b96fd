//! Checkpointed segments built from `burn::nn` layers: masks and indices through a segment,
//! Burn's norms and BatchNorm in a checkpoint-only block, and the first-layer guard that
//! follows the data.

use crate::common;

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
use burn::nn::{
    BatchNorm, BatchNormConfig, Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear,
    LinearConfig, LocalResponseNorm, LocalResponseNormConfig, Softplus, SoftplusConfig,
};
use burn::prelude::*;
use common::{assert_same_grads, param_grads, values, watchdog, Materialise, AB};
use memsave::checkpoint::{recomputations, set_with_cp};
use memsave::fp16::Fp16;
use memsave::{auto_fp16, with_cp};

fn sequence(seed: usize) -> Tensor<AB, 3> {
    let values: Vec<f32> = (0..2 * 6 * 16)
        .map(|i| (((i + seed) * 37 % 29) as f32 / 29.0 - 0.5) * 2.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [2, 6, 16]), &Default::default())
}

fn padding() -> Tensor<AB, 2, Bool> {
    Tensor::from_data(
        [
            [false, false, false, false, true, true],
            [false, false, false, false, false, false],
        ],
        &Default::default(),
    )
}

/// A pre-norm transformer block from Burn's layers, its padding mask passed to the segment; its
/// norms are fp32 islands, so that it also fits in a half-precision model.
#[memsave::model]
#[derive(Module, Debug)]
struct AttentionBlock<B: Backend> {
    #[fp16(fp32)]
    norm1: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    #[fp16(fp32)]
    norm2: LayerNorm<B>,
    mlp: PositionWiseFeedForward<B>,
    with_cp: bool,
}

impl<B: Backend> AttentionBlock<B> {
    fn new(device: &B::Device) -> Self {
        AttentionBlock {
            norm1: LayerNormConfig::new(16).init(device).into(),
            attn: MultiHeadAttentionConfig::new(16, 2)
                .with_dropout(0.0)
                .init(device),
            norm2: LayerNormConfig::new(16).init(device).into(),
            mlp: PositionWiseFeedForwardConfig::new(16, 32)
                .with_dropout(0.0)
                .init(device),
            with_cp: false,
        }
    }
}

impl<B: memsave::Backend> AttentionBlock<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 3>, mask: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let h = self.norm1.forward(x.clone());
        let x = x + self
            .attn
            .forward(MhaInput::self_attn(h).mask_pad(mask))
            .context;
        let h = self.norm2.forward(x.clone());
        x + self.mlp.forward(h)
    }
}

#[test]
fn attention_with_a_padding_mask_is_checkpointed_exactly() {
    watchdog(60, || {
        let plain = AttentionBlock::<AB>::new(&Default::default()).map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = sequence(0).require_grad();

        let out_plain = plain.forward(x.clone(), padding());
        let g_plain = out_plain.clone().sum().backward();
        let before = recomputations();
        let out_cp = checkpointed.forward(x.clone(), padding());
        let g_cp = out_cp.clone().sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        assert_eq!(
            recomputations() - before,
            1,
            "the segment was not recomputed"
        );

        assert_eq!(values(out_cp.inner()), values(out_plain.inner()));
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            0.0,
        );
        assert_eq!(
            values(x.grad(&g_cp).unwrap()),
            values(x.grad(&g_plain).unwrap())
        );
    });
}

/// Token ids in, tags out: int tensors cross the segment as constants.
#[memsave::model]
#[derive(Module, Debug)]
struct Tagger<B: Backend> {
    embed: Embedding<B>,
    linear: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Tagger<B> {
    #[with_cp]
    fn forward(
        &self,
        x: Tensor<B, 3>,
        ids: Tensor<B, 2, Int>,
    ) -> (Tensor<B, 3>, Tensor<B, 2, Int>) {
        let scores = self.linear.forward(x + self.embed.forward(ids));
        let tags = scores.clone().argmax(2).squeeze_dim(2);
        (scores, tags)
    }
}

#[test]
fn int_tensors_cross_a_segment_without_gradient() {
    watchdog(60, || {
        let device = Default::default();
        let plain = Tagger::<AB> {
            embed: EmbeddingConfig::new(10, 16).init(&device),
            linear: LinearConfig::new(16, 5).init(&device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let ids =
            Tensor::<AB, 2, Int>::from_data([[1, 2, 3, 4, 9, 0], [5, 5, 6, 7, 8, 1]], &device);
        let x = sequence(3).require_grad();

        let (scores, tags) = plain.forward(x.clone(), ids.clone());
        let g_plain = scores.sum().backward();
        let before = recomputations();
        let (scores_cp, tags_cp) = checkpointed.forward(x.clone(), ids);
        let g_cp = scores_cp.sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        assert_eq!(recomputations() - before, 1);
        assert_eq!(
            tags_cp.into_data().to_vec::<i32>().unwrap(),
            tags.into_data().to_vec::<i32>().unwrap()
        );
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            0.0,
        );
    });
}

/// Burn's norms (including ones without a half-precision story) and Burn's BatchNorm in a block
/// with only a `with_cp` flag: it compiles, and the statistics move once per step.
#[memsave::model]
#[derive(Module, Debug)]
struct NormBlock<B: Backend> {
    linear: Linear<B>,
    bn: BatchNorm<B>,
    lrn: LocalResponseNorm,
    softplus: Softplus,
    with_cp: bool,
}

impl<B: memsave::Backend> NormBlock<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = self.linear.forward(x).swap_dims(1, 2);
        let x = self.lrn.forward(self.bn.forward(x));
        self.softplus.forward(x).swap_dims(1, 2)
    }
}

#[test]
fn burn_batch_norm_in_a_segment_updates_its_statistics_once() {
    watchdog(60, || {
        let device = Default::default();
        let plain = NormBlock::<AB> {
            linear: LinearConfig::new(16, 8).init(&device),
            bn: BatchNormConfig::new(8).init(&device),
            lrn: LocalResponseNormConfig::new(3).init(),
            softplus: SoftplusConfig::new().init(),
            with_cp: false,
        }
        .map(&mut Materialise);
        // Same weights, separate statistics (clones share their `RunningState`s).
        let checkpointed = NormBlock {
            linear: plain.linear.clone(),
            bn: BatchNormConfig::new(8)
                .init(&device)
                .load_record(plain.bn.clone().into_record()),
            lrn: plain.lrn.clone(),
            softplus: plain.softplus.clone(),
            with_cp: true,
        };
        for step in 0..3 {
            let x = sequence(step).require_grad();
            let g_plain = plain.forward(x.clone()).sum().backward();
            let g_cp = checkpointed.forward(x).sum().backward();
            memsave::checkpoint::join_helpers().unwrap();
            assert_same_grads(
                &param_grads(&checkpointed, &g_cp),
                &param_grads(&plain, &g_plain),
                1e-6,
            );
        }
        let stats = |bn: &BatchNorm<AB>| {
            (
                values(bn.running_mean.value_sync().inner()),
                values(bn.running_var.value_sync().inner()),
            )
        };
        assert_eq!(stats(&checkpointed.bn), stats(&plain.bn));
    });
}

/// The `blocks` field is declared before `input_proj`, which runs first: the guard looks at
/// where the input goes, not at the order of the fields, so this compiles and checkpoints.
#[memsave::model]
#[derive(Module, Debug)]
struct Encoder<B: Backend> {
    #[with_cp]
    blocks: Vec<AttentionBlock<B>>,
    input_proj: Linear<B>,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> Encoder<B> {
    #[auto_fp16]
    fn forward(&self, x: Tensor<B, 3>, mask: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let mut x = self.input_proj.forward(x);
        for block in &self.blocks {
            x = block.forward(x, mask.clone());
        }
        x
    }
}

#[test]
fn blocks_declared_before_the_input_layer_are_checkpointed() {
    watchdog(60, || {
        let device = Default::default();
        let plain = Encoder::<AB> {
            blocks: vec![AttentionBlock::new(&device), AttentionBlock::new(&device)],
            input_proj: LinearConfig::new(16, 16).init(&device),
            fp16_enabled: Fp16::Off,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        assert!(checkpointed.blocks.iter().all(|block| block.with_cp));
        let x = sequence(5);
        let g_plain = plain.forward(x.clone(), padding()).sum().backward();
        let before = recomputations();
        let g_cp = checkpointed.forward(x, padding()).sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        assert_eq!(recomputations() - before, 2);
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            0.0,
        );
    });
}
