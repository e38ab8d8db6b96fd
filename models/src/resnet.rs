//! ResNet (He et al. 2016), PyTorch style (stride on the 3x3 conv), as an MMDetection backbone:
//! it returns the feature maps of its four stages (C2..C5).
//!
//! Built with memsave's DSL: `#[with_cp]` marks every stage, so `with_cp = true` checkpoints
//! every block (MMCV's `with_cp`); unlike MMCV, `BasicBlock` supports it too. The stem is the
//! first layer and is never checkpointed (its input, the image, does not require grad).

use crate::memsave;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::PaddingConfig2d;
use burn::prelude::{Backend, Tensor};
use memsave::checkpoint::HasWithCp;
use memsave::fp16::Fp16;
use memsave::memory;
use memsave::nn::{conv2d, max_pool2d, BatchNorm, BatchNormConfig, Relu};
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
    /// Checkpoint every block (recompute it in backward).
    pub with_cp: bool,
}

impl Default for ResNetConfig {
    fn default() -> Self {
        ResNetConfig {
            kind: BackboneType::ResNet,
            depth: 50,
            in_channels: 3,
            with_cp: false,
        }
    }
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
        self.with_cp = with_cp;
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
        Ok(512 * kind.expansion())
    }

    /// The network, randomly initialised (Kaiming-uniform convolutions, BN at 1 and 0).
    pub fn init<B: Backend>(&self, device: &B::Device) -> memsave::Result<ResNet<B>> {
        let (blocks, kind) = self.layout()?;
        if self.in_channels == 0 {
            return Err(memsave::Error::invalid(
                "model.backbone.in_channels",
                "must be at least 1",
            ));
        }
        let stem = Stem {
            conv: conv(self.in_channels, 64, 7, 2, device),
            bn: BatchNormConfig::new(64).init(device),
            relu: Relu::new(),
            pool: MaxPool2dConfig::new([3, 3])
                .with_strides([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(),
        };
        let mut in_channels = 64;
        let mut stages: Vec<Vec<Block<B>>> = Vec::new();
        for (stage, &count) in blocks.iter().enumerate() {
            let width = 64 << stage;
            let stride = if stage == 0 { 1 } else { 2 };
            let mut layer = Vec::with_capacity(count);
            for index in 0..count {
                let stride = if index == 0 { stride } else { 1 };
                let block = match kind {
                    BlockKind::Basic => {
                        Block::Basic(BasicBlock::new(in_channels, width, stride, device))
                    }
                    BlockKind::Bottleneck => {
                        Block::Bottleneck(Bottleneck::new(in_channels, width, stride, device))
                    }
                };
                in_channels = width * kind.expansion();
                layer.push(block);
            }
            stages.push(layer);
        }
        let mut stages = stages.into_iter();
        let mut next = || stages.next().expect("four stages were built");
        let resnet = ResNet {
            stem,
            layer1: next(),
            layer2: next(),
            layer3: next(),
            layer4: next(),
            fp16_enabled: Fp16::Off,
        };
        Ok(memsave::checkpoint::set_with_cp(resnet, self.with_cp))
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
    /// `[N, C, H, W]` -> `[N, 64, H/4, W/4]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        max_pool2d(&self.pool, self.bn.forward_relu(conv2d(&self.conv, x)))
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
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.bn.forward(conv2d(&self.conv, x))
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

/// 1x1 reduce, 3x3 (with the stride), 1x1 expand by 4, and the skip (ResNet-50/101/152).
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
    fn new(in_channels: usize, width: usize, stride: usize, device: &B::Device) -> Self {
        let out_channels = width * 4;
        Bottleneck {
            conv1: conv(in_channels, width, 1, 1, device),
            bn1: BatchNormConfig::new(width).init(device),
            conv2: conv(width, width, 3, stride, device),
            bn2: BatchNormConfig::new(width).init(device),
            conv3: conv(width, out_channels, 1, 1, device),
            bn3: BatchNormConfig::new(out_channels).init(device),
            downsample: downsample(in_channels, out_channels, stride, device),
            relu: Relu::new(),
            with_cp: false,
        }
    }
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
    fp16_enabled: Fp16,
}

impl<B: memsave::Backend> ResNet<B> {
    /// Images `[N, C, H, W]` -> the four stages' feature maps, strides 4, 8, 16 and 32
    /// (channels 64/128/256/512, times 4 for bottlenecks).
    #[auto_fp16]
    ///
    /// Each block runs in a memory scope named by its path (`stem`, `layer2.1`), so that
    /// `memsave::memory::live_by_tag` between forward and backward tells what each keeps.
    pub fn forward(&self, images: Tensor<B, 4>) -> Vec<Tensor<B, 4>> {
        let mut x = memory::scope("stem", || self.stem.forward(images));
        let mut features = Vec::with_capacity(4);
        let layers = [&self.layer1, &self.layer2, &self.layer3, &self.layer4];
        for (stage, layer) in layers.into_iter().enumerate() {
            for (index, block) in layer.iter().enumerate() {
                let name = format!("layer{}.{index}", stage + 1);
                x = memory::scope(&name, || block.forward(x));
            }
            features.push(x.clone());
        }
        features
    }
}

impl<B: Backend> ResNet<B> {
    /// Every block, stage by stage.
    pub fn blocks(&self) -> impl Iterator<Item = &Block<B>> {
        self.layer1
            .iter()
            .chain(&self.layer2)
            .chain(&self.layer3)
            .chain(&self.layer4)
    }
}
