//! `#[memsave::model]` on Burn 0.22 modules (the runtime `memsave-next`): checkpointing switched
//! on in a whole model, or in the segments a plan names by path, around Burn's own transformer
//! layers; the gradients are the plain run's, bit for bit.

use std::cell::Cell;

use burn::module::Module;
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use memsave_macros::{model, with_cp};
use memsave_next::checkpoint::{segment_paths, set_with_cp, set_with_cp_paths};

use crate::common;
use common::{assert_same_bits, devices, grad_bits, initialized, watchdog};

thread_local! {
    static RUNS: Cell<usize> = const { Cell::new(0) };
}

/// A block: Burn's encoder layer (its dropouts included), switched by its `with_cp` flag.
#[model]
#[derive(Module, Debug)]
struct Block {
    layer: TransformerEncoderLayer,
    with_cp: bool,
}

impl Block {
    #[with_cp]
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        RUNS.with(|runs| runs.set(runs.get() + 1));
        self.layer.forward(x, None, None)
    }
}

/// A model that leads to its blocks through a marked field, with no flag of its own.
#[model]
#[derive(Module, Debug)]
struct Encoder {
    embed: Linear,
    #[with_cp]
    blocks: Vec<Block>,
}

impl Encoder {
    fn new(device: &Device) -> Self {
        let config = TransformerEncoderConfig::new(16, 32, 2, 3).with_dropout(0.25);
        Encoder {
            embed: LinearConfig::new(8, 16).init(device),
            blocks: config
                .init(device)
                .layers
                .into_iter()
                .map(|layer| Block {
                    layer,
                    with_cp: false,
                })
                .collect(),
        }
    }

    /// One step from the stream `seed`: the parameters' gradients and how many times the
    /// blocks' forward ran.
    fn step(&self, device: &Device, seed: u64) -> (Vec<Option<Vec<u32>>>, usize) {
        step(self, &self.embed, device, seed, |h| {
            self.blocks.iter().fold(h, |h, block| block.forward(h))
        })
    }
}

/// One step of `model` from the stream `seed`: `embed`, then `layers`; the parameters' gradients
/// and how many times the layers' forward ran.
fn step<M: Module>(
    model: &M,
    embed: &Linear,
    device: &Device,
    seed: u64,
    layers: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> (Vec<Option<Vec<u32>>>, usize) {
    device.seed(seed);
    RUNS.with(|runs| runs.set(0));
    let x = Tensor::<3>::random([2, 6, 8], Distribution::Default, device);
    let grads = layers(embed.forward(x)).powi_scalar(2).mean().backward();
    (grad_bits(model, &grads), RUNS.with(Cell::get))
}

#[test]
fn a_model_names_its_segments_by_path() {
    // Under the watchdog's turn too: building a model may draw from the shared stream.
    watchdog(60, || {
        let encoder = Encoder::new(&Device::flex().autodiff());
        assert_eq!(
            segment_paths(&encoder),
            ["blocks.0", "blocks.1", "blocks.2"]
        );
    });
}

#[test]
fn set_with_cp_on_a_burn_0_22_model_checkpoints_every_block_exactly() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            device.seed(1);
            let encoder = initialized(Encoder::new(&device));
            let (plain, plain_runs) = encoder.step(&device, 5);
            let encoder = set_with_cp(encoder, true);
            assert!(encoder.blocks.iter().all(|block| block.with_cp));
            let (checkpointed, checkpointed_runs) = encoder.step(&device, 5);
            assert_same_bits(&plain, &checkpointed, strategy);
            // Each block recomputed once: the flags were read.
            assert_eq!((plain_runs, checkpointed_runs), (3, 6), "{strategy}");
        }
    });
}

#[test]
fn set_with_cp_paths_checkpoints_exactly_the_named_blocks() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            device.seed(2);
            let encoder = initialized(Encoder::new(&device));
            let (plain, _) = encoder.step(&device, 6);
            let encoder =
                set_with_cp_paths(encoder, &["blocks.1".to_string()]).expect("a known path");
            let flags: Vec<bool> = encoder.blocks.iter().map(|block| block.with_cp).collect();
            assert_eq!(flags, [false, true, false]);
            let (checkpointed, runs) = encoder.step(&device, 6);
            assert_same_bits(&plain, &checkpointed, strategy);
            assert_eq!(runs, 4, "{strategy}");
        }
    });
}

#[test]
fn an_unknown_path_is_an_error_naming_the_closest_segments() {
    watchdog(60, || {
        let encoder = Encoder::new(&Device::flex().autodiff());
        let error = set_with_cp_paths(encoder, &["blocks.7".to_string()]).expect_err("no blocks.7");
        assert_eq!(
            error.to_string(),
            "with_cp: `blocks.7` is not a checkpointable segment of this model; its 3 segments \
             include `blocks.0`, `blocks.1`, `blocks.2`"
        );
    });
}

/// Burn's own encoder layers, each a segment through `Checkpointed` (no block of one's own, the
/// layer's own forward called in a closure), in a model with no flag of its own.
#[model]
#[derive(Module, Debug)]
struct Wrapped {
    embed: Linear,
    #[with_cp]
    layers: Vec<memsave_next::checkpoint::Checkpointed<TransformerEncoderLayer>>,
}

impl Wrapped {
    /// The same weights as `encoder`'s (its layers, unwrapped from its blocks).
    fn from_blocks(encoder: Encoder) -> Self {
        Wrapped {
            embed: encoder.embed,
            layers: encoder
                .blocks
                .into_iter()
                .map(|block| memsave_next::checkpoint::Checkpointed::new(block.layer))
                .collect(),
        }
    }

    /// One step from the stream `seed`, as `Encoder::step`.
    fn step(&self, device: &Device, seed: u64) -> (Vec<Option<Vec<u32>>>, usize) {
        step(self, &self.embed, device, seed, |h| {
            self.layers.iter().fold(h, |h, layer| {
                layer.forward_with(h, |layer, h| {
                    RUNS.with(|runs| runs.set(runs.get() + 1));
                    layer.forward(h, None, None)
                })
            })
        })
    }
}

#[test]
fn any_burn_module_is_a_segment_through_checkpointed_switched_and_named_as_a_block() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            device.seed(3);
            let encoder = initialized(Encoder::new(&device));
            // The blocks' run, plain: the gradients a wrapped layer must give.
            let (plain, _) = encoder.step(&device, 7);
            let wrapped = Wrapped::from_blocks(encoder);
            assert_eq!(
                segment_paths(&wrapped),
                ["layers.0", "layers.1", "layers.2"]
            );
            let (off, off_runs) = wrapped.step(&device, 7);
            assert_same_bits(&plain, &off, strategy);
            assert_eq!(off_runs, 3, "{strategy}: the switches start off");
            // Every layer: each recomputed once, Burn's dropout (0.25) replayed exactly.
            let wrapped = set_with_cp(wrapped, true);
            let (on, on_runs) = wrapped.step(&device, 7);
            assert_same_bits(&plain, &on, strategy);
            assert_eq!(on_runs, 6, "{strategy}");
            // A plan's path: that layer alone.
            let wrapped = set_with_cp(wrapped, false);
            let wrapped = set_with_cp_paths(wrapped, &["layers.2".to_string()]).unwrap();
            let flags: Vec<bool> = wrapped.layers.iter().map(|layer| layer.with_cp).collect();
            assert_eq!(flags, [false, false, true]);
            let (one, one_runs) = wrapped.step(&device, 7);
            assert_same_bits(&plain, &one, strategy);
            assert_eq!(one_runs, 4, "{strategy}");
        }
    });
}
