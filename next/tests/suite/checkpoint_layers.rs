//! Burn 0.22's own layers inside checkpointed segments (Flex): Burn's `TransformerEncoder` with
//! every layer a segment, its `Dropout`s replayed in the recomputation; a user's layer that draws
//! with `Tensor::random`; Burn's `BatchNorm`, whose running statistics move once per step. Each
//! against the same model with checkpointing off, bit for bit, under both of Burn's strategies.

use burn::module::Module;
use burn::nn::activation::{RRelu, RReluConfig};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::transformer::TransformerEncoderLayer;
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig};
use burn::nn::{
    BatchNorm, BatchNormConfig, GaussianNoise, GaussianNoiseConfig, Linear, LinearConfig,
    PaddingConfig2d,
};
use burn::prelude::*;
use burn::tensor::{Bool, Distribution};
use memsave_macros::with_cp;
use memsave_next::checkpoint::{checkpoint_with, HasWithCp, Options};

use crate::common;
use common::{assert_same_bits, bits, devices, grad_bits, initialized, watchdog};

/// A text encoder from Burn's own layers: an embedding of token features, then Burn's
/// transformer encoder, each of its layers a segment (no forward copied: the segment calls the
/// layer's own).
#[derive(Module, Debug)]
struct Encoder {
    embed: Linear,
    encoder: TransformerEncoder,
}

impl Encoder {
    fn new(device: &Device) -> Self {
        Encoder {
            embed: LinearConfig::new(12, 32).init(device),
            encoder: TransformerEncoderConfig::new(32, 64, 4, 3)
                .with_dropout(0.3)
                .init(device),
        }
    }

    fn forward(&self, x: Tensor<3>, mask_pad: Tensor<2, Bool>, checkpointed: bool) -> Tensor<3> {
        let mut x = self.embed.forward(x);
        for layer in &self.encoder.layers {
            x = checkpoint_with(
                Options::new().enabled(checkpointed),
                layer,
                (x, Some(mask_pad.clone())),
                |layer, (x, mask_pad)| layer.forward(x, mask_pad, None),
            );
        }
        x
    }
}

fn tokens(device: &Device, batch: usize, length: usize) -> Tensor<3> {
    let values: Vec<f32> = (0..batch * length * 12)
        .map(|i| ((i as u64 * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [batch, length, 12]), device)
}

/// The last two positions of the second sequence are padding.
fn padding(device: &Device, batch: usize, length: usize) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..batch * length)
        .map(|i| i / length == 1 && i % length >= length - 2)
        .collect();
    Tensor::from_data(TensorData::new(values, [batch, length]), device)
}

/// The encoder's parameters' gradients after one step whose random stream starts at `seed`.
fn encoder_step(
    encoder: &Encoder,
    device: &Device,
    seed: u64,
    checkpointed: bool,
) -> Vec<Option<Vec<u32>>> {
    device.seed(seed);
    let (batch, length) = (3, 7);
    let y = encoder.forward(
        tokens(device, batch, length),
        padding(device, batch, length),
        checkpointed,
    );
    let grads = y.powi_scalar(2).mean().backward();
    grad_bits(encoder, &grads)
}

#[test]
fn burn_transformer_layers_checkpointed_give_the_plain_gradients_with_their_dropout_replayed() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            device.seed(1);
            let encoder = initialized(Encoder::new(&device));
            let plain = encoder_step(&encoder, &device, 7, false);
            let checkpointed = encoder_step(&encoder, &device, 7, true);
            assert!(
                plain.iter().all(Option::is_some),
                "{strategy}: a gradient is missing"
            );
            assert_same_bits(&plain, &checkpointed, strategy);
            // The dropout draws: another stream gives other gradients, so the equality above
            // needs the recomputation to draw the first forward's masks.
            let other_stream = encoder_step(&encoder, &device, 8, false);
            assert_ne!(plain, other_stream, "{strategy}: the dropout drew nothing");
        }
    });
}

#[test]
fn a_fresh_models_first_step_is_the_same_with_and_without_checkpointing() {
    // Burn initializes a parameter on its first use, from the random stream: inside the first
    // forward here. The two models are built alike and never used before the step.
    watchdog(300, || {
        for (strategy, device) in devices() {
            let fresh = || {
                device.seed(1);
                Encoder::new(&device)
            };
            let plain = encoder_step(&fresh(), &device, 7, false);
            let checkpointed = encoder_step(&fresh(), &device, 7, true);
            assert_same_bits(&plain, &checkpointed, strategy);
        }
    });
}

/// A user's block around Burn's own layer, checkpointed with `#[with_cp]` on its forward: the
/// macro writes Burn 0.22 code where the runtime is `memsave-next`.
#[derive(Module, Debug)]
struct Block {
    layer: TransformerEncoderLayer,
    with_cp: bool,
}

impl HasWithCp for Block {
    fn with_cp(&self) -> bool {
        self.with_cp
    }
}

impl Block {
    #[with_cp]
    fn forward(&self, x: Tensor<3>, mask_pad: Tensor<2, Bool>) -> Tensor<3> {
        RUNS.with(|runs| runs.set(runs.get() + 1));
        self.layer.forward(x, Some(mask_pad), None)
    }
}

thread_local! {
    static RUNS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[test]
fn with_cp_on_a_burn_0_22_module_checkpoints_its_forward_when_the_flag_is_on() {
    watchdog(300, || {
        for (strategy, device) in devices() {
            device.seed(4);
            let config = TransformerEncoderConfig::new(32, 64, 4, 2).with_dropout(0.2);
            let encoder = initialized(config.init(&device));
            let blocks: Vec<Block> = encoder
                .layers
                .into_iter()
                .map(|layer| Block {
                    layer,
                    with_cp: false,
                })
                .collect();
            let step = |blocks: &[Block]| {
                device.seed(9);
                RUNS.with(|runs| runs.set(0));
                // Tracked, so that the first block is checkpointed too (MMCV's guard).
                let mut x =
                    Tensor::<3>::random([2, 5, 32], Distribution::Default, &device).require_grad();
                for block in blocks {
                    x = block.forward(x, padding(&device, 2, 5));
                }
                let grads = x.powi_scalar(2).mean().backward();
                let runs = RUNS.with(std::cell::Cell::get);
                let grads: Vec<_> = blocks
                    .iter()
                    .flat_map(|block| grad_bits(block, &grads))
                    .collect();
                (grads, runs)
            };
            let (plain, plain_runs) = step(&blocks);
            let blocks: Vec<Block> = blocks
                .into_iter()
                .map(|block| Block {
                    with_cp: true,
                    ..block
                })
                .collect();
            let (checkpointed, checkpointed_runs) = step(&blocks);
            assert_same_bits(&plain, &checkpointed, strategy);
            // The flag is read: each block ran once plainly, twice checkpointed (its forward and
            // its recomputation).
            assert_eq!((plain_runs, checkpointed_runs), (2, 4), "{strategy}");
        }
    });
}

/// Values that depend on no random stream.
fn fixed<const D: usize>(device: &Device, shape: [usize; D]) -> Tensor<D> {
    let count = shape.iter().product::<usize>();
    let values: Vec<f32> = (0..count)
        .map(|i| ((i as u64 * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// One step through `layers`, each a segment running `forward` as `options` say, from the stream
/// `seed` on a fixed, tracked input (so that every layer is checkpointed and only the layers'
/// draws depend on the stream): the layers' gradients.
fn noisy_step<M: Module + 'static>(
    layers: &[M],
    device: &Device,
    options: Options,
    seed: u64,
    forward: fn(&M, Tensor<2>) -> Tensor<2>,
) -> Vec<Option<Vec<u32>>> {
    device.seed(seed);
    let mut x = fixed(device, [4, 8]).require_grad();
    for layer in layers {
        x = checkpoint_with(options, layer, x, forward);
    }
    let grads = x.powi_scalar(2).sum().backward();
    layers
        .iter()
        .flat_map(|layer| grad_bits(layer, &grads))
        .collect()
}

/// Burn's other random layers: Gaussian noise and a randomized leaky ReLU.
#[derive(Module, Debug)]
struct NoisyBlock {
    fc: Linear,
    noise: GaussianNoise,
    rrelu: RRelu,
}

#[test]
fn burn_gaussian_noise_and_rrelu_in_a_segment_are_replayed() {
    watchdog(120, || {
        for (strategy, device) in devices() {
            device.seed(3);
            let blocks = initialized(vec![
                NoisyBlock {
                    fc: LinearConfig::new(8, 8).init(&device),
                    noise: GaussianNoiseConfig::new(0.5).init(),
                    rrelu: RReluConfig::new().init(),
                },
                NoisyBlock {
                    fc: LinearConfig::new(8, 8).init(&device),
                    noise: GaussianNoiseConfig::new(0.5).init(),
                    rrelu: RReluConfig::new().init(),
                },
            ]);
            let forward: fn(&NoisyBlock, Tensor<2>) -> Tensor<2> = |block, x| {
                let h = block.noise.forward(block.fc.forward(x));
                block.rrelu.forward(h)
            };
            let step = |checkpointed: bool, seed: u64| {
                let options = Options::new().enabled(checkpointed);
                noisy_step(&blocks, &device, options, seed, forward)
            };
            assert_same_bits(&step(false, 5), &step(true, 5), strategy);
            assert_ne!(step(false, 5), step(false, 6), "{strategy}: nothing drawn");
        }
    });
}

/// A layer of the user's own that draws with `Tensor::random`: multiplicative noise.
#[derive(Module, Debug)]
struct Noisy {
    fc: Linear,
}

impl Noisy {
    fn noisy(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.fc.forward(x);
        let noise = h.random_like(Distribution::Normal(1.0, 0.5));
        h * noise
    }
}

#[test]
fn a_users_layer_that_draws_says_so_and_its_draws_are_replayed() {
    watchdog(120, || {
        for (strategy, device) in devices() {
            device.seed(2);
            let layers = initialized(vec![
                Noisy {
                    fc: LinearConfig::new(8, 8).init(&device),
                },
                Noisy {
                    fc: LinearConfig::new(8, 8).init(&device),
                },
            ]);
            let step = |checkpointed: bool, seed: u64| {
                let options = Options::new().enabled(checkpointed).random(true);
                noisy_step(&layers, &device, options, seed, Noisy::noisy)
            };
            assert_same_bits(&step(false, 5), &step(true, 5), strategy);
            assert_ne!(step(false, 5), step(false, 6), "{strategy}: no noise drawn");
        }
    });
}

/// A convolution and Burn's BatchNorm.
#[derive(Module, Debug)]
struct ConvBn {
    conv: Conv2d,
    bn: BatchNorm,
}

impl ConvBn {
    fn new(device: &Device) -> Self {
        ConvBn {
            conv: Conv2dConfig::new([4, 4], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            bn: BatchNormConfig::new(4).init(device),
        }
    }

    fn plain(&self, x: Tensor<4>) -> Tensor<4> {
        burn::tensor::activation::relu(self.bn.forward(self.conv.forward(x)))
    }
}

/// How a test runs the blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Run {
    Plain,
    Checkpointed,
    /// Checkpointed, but the closure captures a tracked tensor: the segment falls back to
    /// running plainly after its untracked forward.
    Captured,
}

/// Two steps of two BatchNorm blocks; the running statistics after them and the last step's
/// gradients.
fn batch_norm_steps(device: &Device, run: Run) -> (Vec<Option<Vec<u32>>>, Vec<Option<Vec<u32>>>) {
    device.seed(3);
    let blocks = initialized(vec![ConvBn::new(device), ConvBn::new(device)]);
    // A tracked scale of one: the values and gradients stay the plain run's, bit for bit.
    let scale = Tensor::<1>::from_floats([1.0], device).require_grad();
    let mut last = Vec::new();
    for step in 0..2 {
        device.seed(10 + step);
        // Tracked, so that both blocks are checkpointed (MMCV's guard).
        let mut x = Tensor::<4>::random([2, 4, 6, 6], Distribution::Default, device).require_grad();
        for block in &blocks {
            x = match run {
                Run::Plain => block.plain(x),
                Run::Checkpointed => {
                    checkpoint_with(Options::new(), block, x, |block, x| block.plain(x))
                }
                Run::Captured => {
                    let scale = scale.clone();
                    checkpoint_with(Options::new(), block, x, move |block, x| {
                        block.plain(x) * scale.clone().reshape([1, 1, 1, 1])
                    })
                }
            };
        }
        let grads = x.powi_scalar(2).sum().backward();
        last = blocks
            .iter()
            .flat_map(|block| grad_bits(block, &grads))
            .collect();
    }
    let statistics = blocks
        .iter()
        .flat_map(|block| {
            [
                Some(bits(block.bn.running_mean.value_sync())),
                Some(bits(block.bn.running_var.value_sync())),
            ]
        })
        .collect();
    (statistics, last)
}

#[test]
fn burn_batch_norm_in_a_segment_moves_its_running_statistics_once_per_step() {
    watchdog(120, || {
        for (strategy, device) in devices() {
            let (plain_statistics, plain_grads) = batch_norm_steps(&device, Run::Plain);
            let (statistics, grads) = batch_norm_steps(&device, Run::Checkpointed);
            assert_same_bits(
                &plain_statistics,
                &statistics,
                &format!("{strategy}: statistics"),
            );
            assert_same_bits(&plain_grads, &grads, strategy);
            // Per block, the convolution's weight and bias and the norm's gamma and beta (the
            // running statistics are visited too, and have none).
            assert_eq!(grads.iter().flatten().count(), 8, "{strategy}");
            let (statistics, grads) = batch_norm_steps(&device, Run::Captured);
            assert_same_bits(
                &plain_statistics,
                &statistics,
                &format!("{strategy}: statistics, a segment run plainly"),
            );
            assert_same_bits(
                &plain_grads,
                &grads,
                &format!("{strategy}: a segment run plainly"),
            );
            // The statistics moved from their start (zeros and ones).
            let start = bits(Tensor::<1>::zeros([4], &device));
            assert_ne!(plain_statistics[0], Some(start), "{strategy}");
        }
    });
}
