//! ResNet (He et al. 2016) as an MMDetection backbone: it returns the feature maps of the stages
//! in `out_indices` (C2..C5), with MMDetection's `frozen_stages`, `norm_eval`, `style`
//! (`pytorch`: stride on the 3x3 conv; `caffe`: on the first 1x1), `zero_init_residual`,
//! `base_channels` and `init_cfg` (torchvision weights, see [`crate::weights`]).
//!
//! Built with memsave's DSL: `#[with_cp]` marks every stage, so `with_cp = true` checkpoints
//! every block (MMCV's `with_cp`); unlike MMCV, `BasicBlock` supports it too. The stem takes the
//! image and is never checkpointed; a frozen stage is not either (its input does not require
//! grad: MMCV's guard runs it as written).

use crate::memsave;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::PaddingConfig2d;
use std::path::PathBuf;

use burn::prelude::{Backend, Tensor};
use memsave::checkpoint::HasWithCp;
use memsave::fp16::Fp16;
use memsave::memory;
use memsave::nn::{conv2d, BatchNorm, BatchNormConfig, Relu};
use memsave::planner::WithCp;
use memsave::{auto_fp16, with_cp};
use serde::{Deserialize, Serialize};

/// Configuration of a [`ResNet`]: MMDetection's `backbone = dict(type='ResNet', depth=50,
/// ...)`, read straight from a config's `[model.backbone]`; unset keys take the values of
/// `ResNetConfig::default()` (a ResNet-50).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResNetConfig {
    /// `"ResNet"`.
    #[serde(rename = "type")]
    pub kind: BackboneType,
    /// 18, 34 (basic blocks), 50, 101 or 152 (bottlenecks).
    pub depth: usize,
    /// Channels of the input image.
    pub in_channels: usize,
    /// Channels of the stem, and the width of the first stage (64 in torchvision's ResNets;
    /// narrower for small models and test fixtures). Stage `i` is `base_channels << i` wide.
    pub base_channels: usize,
    /// The stages whose feature maps `forward` returns, from 0 (C2) to 3 (C5).
    pub out_indices: Vec<usize>,
    /// `-1`: train everything; `0`: freeze the stem; `k`: the stem and stages 1..=k
    /// (parameters take no gradient and no optimizer state, their BNs run in eval mode).
    pub frozen_stages: i64,
    /// Every BN in eval mode during training (running statistics used and kept as they are;
    /// their weights still train unless frozen). MMDetection's detectors set it.
    pub norm_eval: bool,
    /// Where a bottleneck's stride goes: on the 3x3 conv (`pytorch`) or on the first 1x1
    /// (`caffe`).
    pub style: Style,
    /// Zero the last BN of every block (each residual branch starts as the identity), when the
    /// weights are initialised here rather than loaded.
    pub zero_init_residual: bool,
    /// Which blocks to checkpoint (recompute in backward): `true` every one (MMCV's), `false`
    /// none, `"auto"` those the planner picks for `[memory] memory_budget`, or a list of
    /// module paths of the whole model (`["backbone.layer1.0"]`, as `memsave plan` prints
    /// them), applied once the model is built.
    pub with_cp: WithCp,
    /// Where the weights come from: `{ type = "Pretrained", checkpoint = "PATH" }` loads a
    /// torchvision ResNet state dict (`.pth` or `.safetensors`); absent, random.
    pub init_cfg: Option<InitCfg>,
}

impl Default for ResNetConfig {
    fn default() -> Self {
        ResNetConfig {
            kind: BackboneType::ResNet,
            depth: 50,
            in_channels: 3,
            base_channels: 64,
            out_indices: vec![0, 1, 2, 3],
            frozen_stages: -1,
            norm_eval: false,
            style: Style::Pytorch,
            zero_init_residual: false,
            with_cp: WithCp::Off,
            init_cfg: None,
        }
    }
}

/// Where a bottleneck's stride goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Style {
    /// On the 3x3 conv (torchvision, MMDetection's default).
    #[default]
    Pytorch,
    /// On the first 1x1 conv (the original Caffe models).
    Caffe,
}

/// MMCV's `init_cfg`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum InitCfg {
    /// Weights from a torchvision-layout state dict.
    Pretrained {
        /// A `.pth` / `.pt` (torch.save of a state dict) or `.safetensors` file.
        checkpoint: PathBuf,
    },
}

/// The backbones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackboneType {
    /// He et al.'s residual network.
    #[default]
    ResNet,
}

impl ResNetConfig {
    /// A ResNet of `depth`, the other settings at their defaults.
    pub fn new(depth: usize) -> Self {
        ResNetConfig {
            depth,
            ..Self::default()
        }
    }

    /// With `with_cp` set.
    pub fn with_with_cp(mut self, with_cp: bool) -> Self {
        self.with_cp = if with_cp { WithCp::On } else { WithCp::Off };
        self
    }

    /// With `in_channels` set.
    pub fn with_in_channels(mut self, in_channels: usize) -> Self {
        self.in_channels = in_channels;
        self
    }

    /// Blocks per stage and block kind for the configured depth.
    fn layout(&self) -> memsave::Result<([usize; 4], BlockKind)> {
        Ok(match self.depth {
            18 => ([2, 2, 2, 2], BlockKind::Basic),
            34 => ([3, 4, 6, 3], BlockKind::Basic),
            50 => ([3, 4, 6, 3], BlockKind::Bottleneck),
            101 => ([3, 4, 23, 3], BlockKind::Bottleneck),
            152 => ([3, 8, 36, 3], BlockKind::Bottleneck),
            other => {
                return Err(memsave::Error::invalid(
                    "model.backbone.depth",
                    format!("{other} is not a ResNet depth; use 18, 34, 50, 101 or 152"),
                ))
            }
        })
    }

    /// Channels of the last stage's feature map.
    pub fn out_channels(&self) -> memsave::Result<usize> {
        let (_, kind) = self.layout()?;
        Ok((self.base_channels << 3) * kind.expansion())
    }

    /// Channels of the feature maps `forward` returns, in `out_indices` order.
    pub fn stage_channels(&self) -> memsave::Result<Vec<usize>> {
        let (_, kind) = self.layout()?;
        self.check()?;
        Ok(self
            .out_indices
            .iter()
            .map(|&stage| (self.base_channels << stage) * kind.expansion())
            .collect())
    }

    /// The strides (in pixels of the image) of the feature maps `forward` returns.
    pub fn stage_strides(&self) -> Vec<usize> {
        self.out_indices.iter().map(|&stage| 4 << stage).collect()
    }

    fn check(&self) -> memsave::Result<()> {
        let bad = |field: &str, message: String| {
            Err(memsave::Error::invalid(
                format!("model.backbone.{field}"),
                message,
            ))
        };
        if self.in_channels == 0 {
            return bad("in_channels", "must be at least 1".into());
        }
        if self.base_channels == 0 {
            return bad("base_channels", "must be at least 1".into());
        }
        if self.out_indices.is_empty() {
            return bad("out_indices", "must name at least one stage (0..=3)".into());
        }
        if let Some(stage) = self.out_indices.iter().find(|&&stage| stage > 3) {
            return bad(
                "out_indices",
                format!("{stage} is not a stage; the stages are 0, 1, 2 and 3"),
            );
        }
        if self.out_indices.windows(2).any(|pair| pair[0] >= pair[1]) {
            return bad(
                "out_indices",
                format!("{:?} must increase", self.out_indices),
            );
        }
        if !(-1..=4).contains(&self.frozen_stages) {
            return bad(
                "frozen_stages",
                format!(
                    "{} is out of range: -1 (none), 0 (the stem) or 1..=4 (the stem and stages \
                     up to it)",
                    self.frozen_stages
                ),
            );
        }
        Ok(())
    }

    /// The network: random weights (Kaiming-uniform convolutions, BN at 1 and 0, the last BN
    /// of each block at 0 with `zero_init_residual`), or the weights of `init_cfg`; then the
    /// frozen stages and `norm_eval` applied, and `with_cp` set.
    pub fn init<B: Backend>(&self, device: &B::Device) -> memsave::Result<ResNet<B>> {
        let (blocks, kind) = self.layout()?;
        self.check()?;
        let base = self.base_channels;
        let stem = Stem {
            conv: conv(self.in_channels, base, 7, 2, device),
            bn: BatchNormConfig::new(base).init(device),
            relu: Relu::new(),
            pool: MaxPool2dConfig::new([3, 3])
                .with_strides([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(),
        };
        let mut in_channels = base;
        let mut stages: Vec<Vec<Block<B>>> = Vec::new();
        for (stage, &count) in blocks.iter().enumerate() {
            let width = base << stage;
            let stride = if stage == 0 { 1 } else { 2 };
            let mut layer = Vec::with_capacity(count);
            for index in 0..count {
                let stride = if index == 0 { stride } else { 1 };
                let block = match kind {
                    BlockKind::Basic => {
                        Block::Basic(BasicBlock::new(in_channels, width, stride, device))
                    }
                    BlockKind::Bottleneck => Block::Bottleneck(Bottleneck::new(
                        in_channels,
                        width,
                        stride,
                        self.style,
                        device,
                    )),
                };
                let block = if self.zero_init_residual {
                    block.zero_last_norm()
                } else {
                    block
                };
                in_channels = width * kind.expansion();
                layer.push(block);
            }
            stages.push(layer);
        }
        let mut stages = stages.into_iter();
        let mut next = || stages.next().expect("four stages were built");
        let mut resnet = ResNet {
            stem,
            layer1: next(),
            layer2: next(),
            layer3: next(),
            layer4: next(),
            out_indices: self.out_indices.clone(),
            fp16_enabled: Fp16::Off,
        };
        if let Some(InitCfg::Pretrained { checkpoint }) = &self.init_cfg {
            resnet = crate::weights::load_torchvision_resnet(resnet, checkpoint)?;
        }
        if self.norm_eval {
            resnet = resnet.norm_eval();
        }
        resnet = resnet.freeze_stages(self.frozen_stages);
        Ok(memsave::checkpoint::set_with_cp(
            resnet,
            self.with_cp.starts_on(),
        ))
    }
}

#[derive(Clone, Copy)]
enum BlockKind {
    Basic,
    Bottleneck,
}

impl BlockKind {
    fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// A `k x k` convolution without bias, padded to keep the size at stride 1.
fn conv<B: Backend>(
    in_channels: usize,
    out_channels: usize,
    kernel: usize,
    stride: usize,
    device: &B::Device,
) -> Conv2d<B> {
    let pad = kernel / 2;
    Conv2dConfig::new([in_channels, out_channels], [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .with_bias(false)
        .init(device)
}

/// conv 7x7/2, BN, ReLU, max-pool 3x3/2: `[N, C, H, W]` -> `[N, 64, H/4, W/4]`.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Stem<B: Backend> {
    conv: Conv2d<B>,
    bn: BatchNorm<B>,
    relu: Relu,
    pool: MaxPool2d,
}

impl<B: Backend> Stem<B> {
    /// `[N, C, H, W]` -> `[N, base_channels, H/4, W/4]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.bn
            .forward_relu_max_pool(conv2d(&self.conv, x), &self.pool)
    }

    fn norm_eval(self) -> Self {
        Stem {
            bn: self.bn.with_eval(true),
            ..self
        }
    }
}

/// The 1x1 convolution and BN that match the skip path to a block's output.
#[memsave::model]
#[derive(Module, Debug)]
pub struct Downsample<B: Backend> {
    conv: Conv2d<B>,
    bn: BatchNorm<B>,
}

impl<B: Backend> Downsample<B> {
    fn new(in_channels: usize, out_channels: usize, stride: usize, device: &B::Device) -> Self {
        Downsample {
            conv: conv(in_channels, out_channels, 1, stride, device),
            bn: BatchNormConfig::new(out_channels).init(device),
        }
    }

    /// `[N, C_in, H, W]` -> `[N, C_out, H/s, W/s]`.
    ///
    /// Keeps only `x` (the block's input, which the block's first convolution keeps anyway):
    /// the convolution's output is recomputed in backward.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.bn.forward_after_conv(&self.conv, x)
    }

    fn norm_eval(self) -> Self {
        Downsample {
            bn: self.bn.with_eval(true),
            ..self
        }
    }
}

fn downsample<B: Backend>(
    in_channels: usize,
    out_channels: usize,
    stride: usize,
    device: &B::Device,
) -> Option<Downsample<B>> {
    (stride != 1 || in_channels != out_channels)
        .then(|| Downsample::new(in_channels, out_channels, stride, device))
}

/// The skip path of a block: `x`, or `x` through the downsample.
fn skip<B: Backend>(downsample: &Option<Downsample<B>>, x: &Tensor<B, 4>) -> Tensor<B, 4> {
    match downsample {
        Some(downsample) => downsample.forward(x.clone()),
        None => x.clone(),
    }
}

/// Two 3x3 convolutions and the skip (ResNet-18/34).
#[memsave::model]
#[derive(Module, Debug)]
pub struct BasicBlock<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    downsample: Option<Downsample<B>>,
    relu: Relu,
    with_cp: bool,
}

impl<B: Backend> BasicBlock<B> {
    fn new(in_channels: usize, width: usize, stride: usize, device: &B::Device) -> Self {
        BasicBlock {
            conv1: conv(in_channels, width, 3, stride, device),
            bn1: BatchNormConfig::new(width).init(device),
            conv2: conv(width, width, 3, 1, device),
            bn2: BatchNormConfig::new(width).init(device),
            downsample: downsample(in_channels, width, stride, device),
            relu: Relu::new(),
            with_cp: false,
        }
    }

    fn norm_eval(self) -> Self {
        BasicBlock {
            bn1: self.bn1.with_eval(true),
            bn2: self.bn2.with_eval(true),
            downsample: self.downsample.map(Downsample::norm_eval),
            ..self
        }
    }

    fn zero_last_norm(self) -> Self {
        BasicBlock {
            bn2: zeroed(self.bn2),
            ..self
        }
    }
}

impl<B: memsave::Backend> BasicBlock<B> {
    /// `[N, C_in, H, W]` -> `[N, width, H/s, W/s]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.relu.forward(self.residual(x))
    }

    /// Everything but the final ReLU, checkpointed as one segment when `with_cp` is on.
    #[with_cp]
    fn residual(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let identity = skip(&self.downsample, &x);
        // Each BN-ReLU and the conv after it are one op keeping only the BN's input.
        let y = self
            .bn1
            .forward_relu_conv(conv2d(&self.conv1, x), &self.conv2);
        self.bn2.forward(y) + identity
    }
}

/// 1x1 reduce, 3x3, 1x1 expand by 4, and the skip (ResNet-50/101/152); the stride on the 3x3
/// (`pytorch` style) or on the first 1x1 (`caffe`).
#[memsave::model]
#[derive(Module, Debug)]
pub struct Bottleneck<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    conv3: Conv2d<B>,
    bn3: BatchNorm<B>,
    downsample: Option<Downsample<B>>,
    relu: Relu,
    with_cp: bool,
}

impl<B: Backend> Bottleneck<B> {
    fn new(
        in_channels: usize,
        width: usize,
        stride: usize,
        style: Style,
        device: &B::Device,
    ) -> Self {
        let out_channels = width * 4;
        let (stride1, stride2) = match style {
            Style::Pytorch => (1, stride),
            Style::Caffe => (stride, 1),
        };
        Bottleneck {
            conv1: conv(in_channels, width, 1, stride1, device),
            bn1: BatchNormConfig::new(width).init(device),
            conv2: conv(width, width, 3, stride2, device),
            bn2: BatchNormConfig::new(width).init(device),
            conv3: conv(width, out_channels, 1, 1, device),
            bn3: BatchNormConfig::new(out_channels).init(device),
            downsample: downsample(in_channels, out_channels, stride, device),
            relu: Relu::new(),
            with_cp: false,
        }
    }

    fn norm_eval(self) -> Self {
        Bottleneck {
            bn1: self.bn1.with_eval(true),
            bn2: self.bn2.with_eval(true),
            bn3: self.bn3.with_eval(true),
            downsample: self.downsample.map(Downsample::norm_eval),
            ..self
        }
    }

    fn zero_last_norm(self) -> Self {
        Bottleneck {
            bn3: zeroed(self.bn3),
            ..self
        }
    }
}

/// `bn` with its scale at 0: the block's residual branch starts at 0.
fn zeroed<B: Backend>(bn: BatchNorm<B>) -> BatchNorm<B> {
    let gamma = bn.gamma.map(|gamma| gamma.zeros_like());
    BatchNorm { gamma, ..bn }
}

impl<B: memsave::Backend> Bottleneck<B> {
    /// `[N, C_in, H, W]` -> `[N, 4 * width, H/s, W/s]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.relu.forward(self.residual(x))
    }

    /// conv1..bn3, the downsample and the residual add: MMCV's checkpointed part; the final
    /// ReLU stays outside.
    #[with_cp]
    fn residual(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let identity = skip(&self.downsample, &x);
        // Each BN-ReLU and the conv after it are one op keeping only the BN's input.
        let y = self
            .bn1
            .forward_relu_conv(conv2d(&self.conv1, x), &self.conv2);
        let y = self.bn2.forward_relu_conv(y, &self.conv3);
        self.bn3.forward(y) + identity
    }
}

/// A residual block of either kind.
// A few dozen blocks per network: the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
#[memsave::model]
#[derive(Module, Debug)]
pub enum Block<B: Backend> {
    /// ResNet-18/34.
    Basic(#[with_cp] BasicBlock<B>),
    /// ResNet-50/101/152.
    Bottleneck(#[with_cp] Bottleneck<B>),
}

impl<B: memsave::Backend> Block<B> {
    /// The block's forward.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        match self {
            Block::Basic(block) => block.forward(x),
            Block::Bottleneck(block) => block.forward(x),
        }
    }
}

impl<B: Backend> Block<B> {
    fn norm_eval(self) -> Self {
        match self {
            Block::Basic(block) => Block::Basic(block.norm_eval()),
            Block::Bottleneck(block) => Block::Bottleneck(block.norm_eval()),
        }
    }

    fn zero_last_norm(self) -> Self {
        match self {
            Block::Basic(block) => Block::Basic(block.zero_last_norm()),
            Block::Bottleneck(block) => Block::Bottleneck(block.zero_last_norm()),
        }
    }

    /// Whether this block is checkpointed.
    pub fn with_cp(&self) -> bool {
        match self {
            Block::Basic(block) => block.with_cp(),
            Block::Bottleneck(block) => block.with_cp(),
        }
    }
}

/// The ResNet backbone: stem and four stages.
#[memsave::model]
#[derive(Module, Debug)]
pub struct ResNet<B: Backend> {
    stem: Stem<B>,
    #[with_cp]
    layer1: Vec<Block<B>>,
    #[with_cp]
    layer2: Vec<Block<B>>,
    #[with_cp]
    layer3: Vec<Block<B>>,
    #[with_cp]
    layer4: Vec<Block<B>>,
    /// The stages whose feature maps `forward` returns.
    #[module(skip)]
    out_indices: Vec<usize>,
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> ResNet<B> {
    /// Images `[N, C, H, W]` -> the feature maps of the stages in `out_indices`, strides 4, 8,
    /// 16 and 32 (channels `base_channels` x 1/2/4/8, times 4 for bottlenecks).
    ///
    /// Each block runs in a memory scope named by its path (`stem`, `layer2.1`), so that
    /// `memsave::memory::live_by_tag` between forward and backward tells what each keeps.
    #[auto_fp16]
    pub fn forward(&self, images: Tensor<B, 4>) -> Vec<Tensor<B, 4>> {
        let mut x = memory::scope("stem", || self.stem.forward(images));
        let last = self.out_indices.last().copied().unwrap_or(3);
        let mut features = Vec::with_capacity(self.out_indices.len());
        let layers = [&self.layer1, &self.layer2, &self.layer3, &self.layer4];
        for (stage, layer) in layers.into_iter().enumerate().take(last + 1) {
            for (index, block) in layer.iter().enumerate() {
                let name = format!("layer{}.{index}", stage + 1);
                x = memory::scope(&name, || block.forward(x));
            }
            if self.out_indices.contains(&stage) {
                features.push(x.clone());
            }
        }
        features
    }
}

impl<B: Backend> ResNet<B> {
    /// Every BN in eval mode (MMDetection's `norm_eval`).
    pub fn norm_eval(self) -> Self {
        let eval = |layer: Vec<Block<B>>| layer.into_iter().map(Block::norm_eval).collect();
        ResNet {
            stem: self.stem.norm_eval(),
            layer1: eval(self.layer1),
            layer2: eval(self.layer2),
            layer3: eval(self.layer3),
            layer4: eval(self.layer4),
            ..self
        }
    }

    /// Freezes the stem (`stages >= 0`) and stages 1..=`stages`: no gradient for their
    /// parameters, their BNs in eval mode (MMDetection's `frozen_stages`; -1 freezes nothing).
    pub fn freeze_stages(self, stages: i64) -> Self {
        let frozen = |stage: i64| stages >= stage;
        let freeze = |layer: Vec<Block<B>>, stage: i64| -> Vec<Block<B>> {
            if frozen(stage) {
                layer
                    .into_iter()
                    .map(|block| block.norm_eval().no_grad())
                    .collect()
            } else {
                layer
            }
        };
        let stem = if frozen(0) {
            self.stem.norm_eval().no_grad()
        } else {
            self.stem
        };
        ResNet {
            stem,
            layer1: freeze(self.layer1, 1),
            layer2: freeze(self.layer2, 2),
            layer3: freeze(self.layer3, 3),
            layer4: freeze(self.layer4, 4),
            ..self
        }
    }

    /// Every block, stage by stage.
    pub fn blocks(&self) -> impl Iterator<Item = &Block<B>> {
        self.layer1
            .iter()
            .chain(&self.layer2)
            .chain(&self.layer3)
            .chain(&self.layer4)
    }
}
