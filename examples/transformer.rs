//! A model nobody here wrote for memsave: a pre-norm transformer encoder for sequence
//! classification, built from `burn::nn` layers with memsave's DSL. Token embedding and
//! positional encoding, then blocks of multi-head attention with a padding mask and a
//! feed-forward (both with Burn's dropout inside), LayerNorms kept fp32 as islands, memsave's
//! dropout on the residuals, every block `#[with_cp]`; mean over the real tokens, a linear head.
//!
//! ```text
//! cargo run --release --example transformer
//! cargo run --release --example transformer -- --seq-len 1024 --layers 6
//! ```
//!
//! It runs one training step each way and prints:
//! - checkpointed against plain, fp32, dropout on, same seed: the max relative gradient
//!   difference over every parameter (0: the recomputation draws the same masks);
//! - f16 and bf16 (`wrap_fp16_model`, LayerNorms fp32, every block checkpointed, a static loss
//!   scale of 1024): the loss and the max relative gradient difference against fp32, dropout
//!   off so that the three see the same network;
//! - the peak memory of a plain and of a checkpointed step at `--seq-len`, interleaved, and
//!   `memory_ratio=<cp/plain> time_ratio=<cp/plain>` (medians of `--steps`);
//! - `with_cp = "dynamic"` in memsave's runner on batches of varying length (`--seq-len`, a
//!   quarter and a half of it in turn) at `--dynamic-budget` of the first step's peak without
//!   checkpointing: every step's measured peak against the budget, and the blocks kept and
//!   recomputed at each length.

use std::collections::HashMap;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
use burn::nn::{
    Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig,
    PositionalEncoding, PositionalEncodingConfig,
};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use clap::Parser;
use memsave::checkpoint::{join_helpers, set_with_cp};
use memsave::fp16::{wrap_fp16_model, Fp16, Precision};
use memsave::memory::{self, CountingAllocator};
use memsave::nn::{Dropout, DropoutConfig};
use memsave::{auto_fp16, force_fp32, with_cp};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

type AB = Autodiff<Flex>;

#[derive(Parser, Debug)]
struct Args {
    /// Tokens per sequence in the memory measurement.
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Encoder blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Width of the model.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Measured steps of each kind (after one warm-up of each).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// The budget of the varying-length run under `with_cp = "dynamic"`: a share of the
    /// first (longest) step's peak without checkpointing.
    #[arg(long, default_value = "70%")]
    dynamic_budget: String,
    /// Steps of the varying-length run (the first is its profile).
    #[arg(long, default_value_t = 7)]
    dynamic_steps: usize,
}

/// Batches whose sequences are `lengths` long in turn (the first the longest).
struct Lengths {
    config: Config,
    batch: usize,
    lengths: Vec<usize>,
}

impl memsave::train::DataSource<AB, (Tensor<AB, 2, Int>, Tensor<AB, 1, Int>)> for Lengths {
    fn batches_per_epoch(&self) -> usize {
        self.lengths.len()
    }

    fn batch(
        &self,
        _epoch: usize,
        index: usize,
        _device: &burn::backend::flex::FlexDevice,
    ) -> memsave::Result<(Tensor<AB, 2, Int>, Tensor<AB, 1, Int>)> {
        Ok(batch(self.config, self.batch, self.lengths[index]))
    }
}

impl memsave::train::TrainModel<AB> for Classifier<AB> {
    type Batch = (Tensor<AB, 2, Int>, Tensor<AB, 1, Int>);

    fn loss(&self, (tokens, labels): Self::Batch) -> Tensor<AB, 1> {
        Classifier::loss(self, self.forward(tokens), labels)
    }
}

/// One pre-norm encoder block: `x + drop(attn(norm1(x)))`, then `x + drop(mlp(norm2(x)))`.
#[memsave::model]
#[derive(Module, Debug)]
struct EncoderBlock<B: Backend> {
    #[fp16(fp32)]
    norm1: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    #[fp16(fp32)]
    norm2: LayerNorm<B>,
    mlp: PositionWiseFeedForward<B>,
    drop: Dropout,
    with_cp: bool,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> EncoderBlock<B> {
    /// `x`: `[batch, seq, d_model]`; `padding`: `[batch, seq]`, true on padded tokens.
    #[with_cp]
    fn forward(&self, x: Tensor<B, 3>, padding: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let h = self.norm1.forward(x.clone());
        let h = self
            .attn
            .forward(MhaInput::self_attn(h).mask_pad(padding))
            .context;
        let x = x + self.drop.forward(h);
        let h = self.mlp.forward(self.norm2.forward(x.clone()));
        x + self.drop.forward(h)
    }
}

#[memsave::model]
#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    embed: Embedding<B>,
    position: PositionalEncoding<B>,
    #[with_cp]
    blocks: Vec<EncoderBlock<B>>,
    #[fp16(fp32)]
    norm: LayerNorm<B>,
    head: Linear<B>,
    fp16_enabled: Fp16,
}

#[derive(Clone, Copy)]
struct Config {
    vocab: usize,
    classes: usize,
    d_model: usize,
    layers: usize,
    max_len: usize,
    dropout: f64,
}

impl<B: memsave::Backend> Classifier<B> {
    fn new(config: Config, device: &B::Device) -> Self {
        let d = config.d_model;
        let block = || EncoderBlock {
            norm1: LayerNormConfig::new(d).init(device).into(),
            attn: MultiHeadAttentionConfig::new(d, 4)
                .with_dropout(config.dropout)
                .init(device),
            norm2: LayerNormConfig::new(d).init(device).into(),
            mlp: PositionWiseFeedForwardConfig::new(d, 4 * d)
                .with_dropout(config.dropout)
                .init(device),
            drop: DropoutConfig::new(config.dropout).init(),
            with_cp: false,
            fp16_enabled: Fp16::Off,
        };
        Classifier {
            embed: EmbeddingConfig::new(config.vocab, d).init(device),
            position: PositionalEncodingConfig::new(d)
                .with_max_sequence_size(config.max_len)
                .init(device),
            blocks: (0..config.layers).map(|_| block()).collect(),
            norm: LayerNormConfig::new(d).init(device).into(),
            head: LinearConfig::new(d, config.classes).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    /// Token ids `[batch, seq]` (0 is padding) -> logits `[batch, classes]`.
    #[auto_fp16]
    fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 2> {
        let padding = tokens.clone().equal_elem(0);
        let mut x = self.position.forward(self.embed.forward(tokens));
        for block in &self.blocks {
            x = block.forward(x, padding.clone());
        }
        let x = self.norm.forward(x);
        // Mean over the real tokens.
        let keep = padding
            .bool_not()
            .float()
            .cast(x.dtype())
            .unsqueeze_dim::<3>(2);
        let pooled = (x * keep.clone()).sum_dim(1) / keep.sum_dim(1);
        self.head.forward(pooled.squeeze_dim(1))
    }

    /// Cross-entropy in fp32, whatever precision the logits come in (MMCV's `force_fp32`).
    #[force_fp32(args = (logits))]
    fn loss(&self, logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels)
    }
}

/// Initialises every lazy parameter, so that clones share their values.
struct Materialise;
impl burn::module::ModuleMapper<AB> for Materialise {}

/// Every parameter's gradient as fp32 values, by id.
fn gradients<M: Module<AB>>(
    model: &M,
    grads: &<AB as AutodiffBackend>::Gradients,
) -> HashMap<ParamId, Vec<f32>> {
    struct Collect<'a>(
        &'a <AB as AutodiffBackend>::Gradients,
        HashMap<ParamId, Vec<f32>>,
    );
    impl ModuleVisitor<AB> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(grad) = param.val().grad(self.0) {
                let values = grad.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
                self.1.insert(param.id, values);
            }
        }
    }
    let mut collect = Collect(grads, HashMap::new());
    model.visit(&mut collect);
    collect.1
}

/// Max over parameters of `max |a - b| / max |b|` (against the largest gradient for one that is
/// zero in exact arithmetic, such as the attention's key bias).
fn max_relative_difference(a: &HashMap<ParamId, Vec<f32>>, b: &HashMap<ParamId, Vec<f32>>) -> f32 {
    assert_eq!(a.len(), b.len(), "gradients for other parameters");
    let abs_max = |v: &[f32]| v.iter().fold(0.0_f32, |m, x| m.max(x.abs()));
    let largest = b.values().fold(0.0_f32, |m, v| m.max(abs_max(v)));
    b.iter()
        .map(|(id, reference)| {
            let got = &a[id];
            let diff = got
                .iter()
                .zip(reference)
                .fold(0.0_f32, |m, (x, y)| m.max((x - y).abs()));
            let scale = abs_max(reference);
            let scale = if scale < 1e-3 * largest {
                largest
            } else {
                scale
            };
            diff / scale.max(f32::MIN_POSITIVE)
        })
        .fold(0.0, f32::max)
}

/// A batch of sequences with some padding at the end of each.
fn batch(config: Config, batch: usize, seq_len: usize) -> (Tensor<AB, 2, Int>, Tensor<AB, 1, Int>) {
    let device = Default::default();
    let mut tokens = Vec::with_capacity(batch * seq_len);
    for row in 0..batch {
        let length = seq_len - (row * 7) % (seq_len / 4).max(1);
        for position in 0..seq_len {
            tokens.push(if position < length {
                1 + ((row * 31 + position * 17) % (config.vocab - 1)) as i64
            } else {
                0
            });
        }
    }
    let labels = (0..batch as i64)
        .map(|i| i % config.classes as i64)
        .collect();
    (
        Tensor::from_data(TensorData::new(tokens, [batch, seq_len]), &device),
        Tensor::from_data(TensorData::new(labels, [batch]), &device),
    )
}

/// One step's gradients from `seed`, the loss multiplied by `scale` for the backward pass
/// (static loss scaling: f16 gradients below 6e-8 would flush to zero) and the gradients
/// divided back.
fn step(
    model: &Classifier<AB>,
    tokens: &Tensor<AB, 2, Int>,
    labels: &Tensor<AB, 1, Int>,
    seed: u64,
    scale: f32,
) -> (f32, HashMap<ParamId, Vec<f32>>) {
    AB::seed(&Default::default(), seed);
    let loss = model.loss(model.forward(tokens.clone()), labels.clone());
    let value = loss.clone().into_scalar();
    let grads = loss.mul_scalar(scale).backward();
    join_helpers().unwrap();
    let mut grads = gradients(model, &grads);
    for values in grads.values_mut() {
        values.iter_mut().for_each(|value| *value /= scale);
    }
    (value, grads)
}

fn main() {
    let args = Args::parse();
    let device = Default::default();
    let config = Config {
        vocab: 1000,
        classes: 10,
        d_model: args.d_model,
        layers: args.layers,
        max_len: args.seq_len.max(64),
        dropout: 0.1,
    };

    // 1. Checkpointing changes nothing: dropout on, one seed, gradients compared bit for bit.
    let plain = Classifier::<AB>::new(config, &device).map(&mut Materialise);
    let checkpointed = set_with_cp(plain.clone(), true);
    let (tokens, labels) = batch(config, 4, 64);
    let (_, g_plain) = step(&plain, &tokens, &labels, 42, 1.0);
    let (_, g_cp) = step(&checkpointed, &tokens, &labels, 42, 1.0);
    let (_, g_other_seed) = step(&plain, &tokens, &labels, 43, 1.0);
    println!(
        "checkpointed vs plain (fp32, dropout {}, {} blocks, {} parameter tensors): max relative \
         gradient difference {:e} (another seed: {:.2e}, so the masks matter)",
        config.dropout,
        config.layers,
        g_plain.len(),
        max_relative_difference(&g_cp, &g_plain),
        max_relative_difference(&g_other_seed, &g_plain),
    );

    // 2. Half precision: the same weights, dropout off, against fp32.
    let quiet = Config {
        dropout: 0.0,
        ..config
    };
    let fp32 = Classifier::<AB>::new(quiet, &device).load_record(plain.clone().into_record());
    let (fp32_loss, g_fp32) = step(&fp32, &tokens, &labels, 0, 1.0);
    println!("fp32 step: loss {fp32_loss:.5}");
    for precision in [Precision::F16, Precision::Bf16] {
        let half = set_with_cp(wrap_fp16_model(fp32.clone(), precision), true);
        let (loss, g_half) = step(&half, &tokens, &labels, 0, 1024.0);
        println!(
            "{precision} step, every block checkpointed, loss scale 1024: loss {loss:.5}, max \
             relative gradient difference from fp32 {:.2e}",
            max_relative_difference(&g_half, &g_fp32)
        );
    }

    // 3. Memory at a length where attention dominates: plain and checkpointed, interleaved.
    let (tokens, labels) = batch(config, args.batch, args.seq_len);
    let mut model = plain;
    let mut peaks = [Vec::new(), Vec::new()];
    let mut seconds = [Vec::new(), Vec::new()];
    eprintln!(
        "memory: batch {} x {} tokens, d_model {}, {} blocks (warm-up, then {} steps each)",
        args.batch, args.seq_len, args.d_model, args.layers, args.steps
    );
    for round in 0..=args.steps {
        for kind in [round % 2, 1 - round % 2] {
            model = set_with_cp(model, kind == 1);
            let baseline = memory::reset_peak();
            let start = Instant::now();
            let loss = model.loss(model.forward(tokens.clone()), labels.clone());
            drop(loss.backward());
            join_helpers().unwrap();
            let elapsed = start.elapsed().as_secs_f64();
            let peak = memory::peak_bytes().saturating_sub(baseline);
            if round > 0 {
                peaks[kind].push(peak as f64 / (1 << 20) as f64);
                seconds[kind].push(elapsed);
            }
        }
    }
    let median = |values: &mut Vec<f64>| {
        values.sort_by(|a, b| a.partial_cmp(b).unwrap());
        values[values.len() / 2]
    };
    let (plain_mib, cp_mib) = (median(&mut peaks[0]), median(&mut peaks[1]));
    let (plain_s, cp_s) = (median(&mut seconds[0]), median(&mut seconds[1]));
    println!(
        "plain: {plain_mib:.1} MiB, {plain_s:.2} s; every block checkpointed: {cp_mib:.1} MiB, \
         {cp_s:.2} s"
    );
    println!(
        "checkpoint: memory_ratio={:.2} time_ratio={:.2}",
        cp_mib / plain_mib,
        cp_s / plain_s
    );

    // 4. Batches of varying length under `with_cp = "dynamic"`, in memsave's runner.
    if let Err(error) = dynamic(&args, config, model) {
        eprintln!("the varying-length run: {error}");
        std::process::exit(1);
    }
}

/// Trains `model` on batches of `--seq-len`, a quarter and half of it in turn, under
/// `with_cp = "dynamic"` at `--dynamic-budget`, and prints what each step chose and measured.
fn dynamic(args: &Args, config: Config, model: Classifier<AB>) -> memsave::Result<()> {
    use memsave::planner::{Budget, DynamicHook, ModelKeys};
    use memsave::train::{OptimizerKind, RunLength, Runner};
    let budget = Budget::parse(&args.dynamic_budget, "--dynamic-budget")?;
    let lengths = vec![
        args.seq_len,
        (args.seq_len / 4).max(8),
        (args.seq_len / 2).max(8),
    ];
    let data = Lengths {
        config,
        batch: args.batch,
        lengths: lengths.clone(),
    };
    let work_dir = std::env::temp_dir().join(format!("memsave-transformer-{}", std::process::id()));
    let mut runner = Runner::new(
        set_with_cp(model, true),
        &OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        },
        Box::new(memsave::hooks::OptimizerHook::new()),
        data,
        RunLength::Iters(args.dynamic_steps),
        &work_dir,
        Default::default(),
    )?;
    runner.set_lr(1e-3)?;
    let keys = ModelKeys {
        with_cp: "with_cp",
        batch: "--batch",
        also_with_cp: &[],
    };
    let device = burn::backend::flex::FlexDevice;
    let hook = DynamicHook::new(budget, keys, &device)?.with_log_interval(1);
    let figures = hook.figures();
    runner.register_hook(Box::new(hook));
    runner.run()?;
    let _ = std::fs::remove_dir_all(&work_dir);
    let figures = figures.borrow();
    println!(
        "dynamic at {} ({:.1} MiB), lengths {lengths:?} in turn: {} steps after the profile, \
         highest step peak {:.1} MiB ({}); blocks kept {} and recomputed {}",
        args.dynamic_budget,
        figures.budget as f64 / (1 << 20) as f64,
        figures.steps,
        figures.highest_peak as f64 / (1 << 20) as f64,
        if figures.highest_peak <= figures.budget {
            "within the budget"
        } else {
            "OVER the budget"
        },
        figures.kept,
        figures.recomputed
    );
    for (size, (steps, kept, recomputed)) in &figures.by_size {
        println!("  input {size}: {steps} steps, kept {kept}, recomputed {recomputed}");
    }
    Ok(())
}
