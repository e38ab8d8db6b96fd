//! The ResNet's modules: the stem, the downsample, the basic block and the bottleneck, and the
//! block that is either. Each BatchNorm-ReLU and the convolution after it are one op keeping
//! only the BatchNorm's input (`memsave_next::nn::BatchNorm::forward_relu_conv`).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::MaxPool2d;
use burn::nn::PaddingConfig2d;
use burn::prelude::*;
use memsave_macros::{model, with_cp};
use memsave_next::nn::{relu, BatchNorm, BatchNormConfig};

use super::Style;

/// A `k x k` convolution without bias, padded to keep the size at stride 1.
pub(super) fn conv(
    in_channels: usize,
    out_channels: usize,
    kernel: usize,
    stride: usize,
    device: &Device,
) -> Conv2d {
    let pad = kernel / 2;
    Conv2dConfig::new([in_channels, out_channels], [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .with_bias(false)
        .init(device)
}

/// conv 7x7/2, BN, ReLU, max-pool 3x3/2: `[N, C, H, W]` -> `[N, 64, H/4, W/4]`.
#[model]
#[derive(Module, Debug)]
pub struct Stem {
    pub(super) conv: Conv2d,
    pub(super) bn: BatchNorm,
    pub(super) pool: MaxPool2d,
}

impl Stem {
    pub(super) fn norm_eval(self) -> Self {
        Stem {
            bn: self.bn.with_eval(true),
            ..self
        }
    }

    /// `[N, C, H, W]` -> `[N, base_channels, H/4, W/4]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.pool
            .forward(self.bn.forward_relu(self.conv.forward(x)))
    }
}

/// The 1x1 convolution and BN that match the skip path to a block's output.
#[model]
#[derive(Module, Debug)]
pub struct Downsample {
    conv: Conv2d,
    bn: BatchNorm,
}

impl Downsample {
    fn new(in_channels: usize, out_channels: usize, stride: usize, device: &Device) -> Self {
        Downsample {
            conv: conv(in_channels, out_channels, 1, stride, device),
            bn: BatchNormConfig::new(out_channels).init(device),
        }
    }

    /// `[N, C_in, H, W]` -> `[N, C_out, H/s, W/s]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.bn.forward(self.conv.forward(x))
    }

    fn norm_eval(self) -> Self {
        Downsample {
            bn: self.bn.with_eval(true),
            ..self
        }
    }
}

fn downsample(
    in_channels: usize,
    out_channels: usize,
    stride: usize,
    device: &Device,
) -> Option<Downsample> {
    (stride != 1 || in_channels != out_channels)
        .then(|| Downsample::new(in_channels, out_channels, stride, device))
}

/// The skip path of a block: `x`, or `x` through the downsample.
fn skip(downsample: &Option<Downsample>, x: &Tensor<4>) -> Tensor<4> {
    match downsample {
        Some(downsample) => downsample.forward(x.clone()),
        None => x.clone(),
    }
}

/// `bn` with its scale at 0: the block's residual branch starts at 0.
fn zeroed(bn: BatchNorm) -> BatchNorm {
    let gamma = bn.gamma.map(|gamma| gamma.zeros_like());
    BatchNorm { gamma, ..bn }
}

/// Two 3x3 convolutions and the skip (ResNet-18/34).
#[model]
#[derive(Module, Debug)]
pub struct BasicBlock {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    downsample: Option<Downsample>,
    with_cp: bool,
}

impl BasicBlock {
    pub(super) fn new(in_channels: usize, width: usize, stride: usize, device: &Device) -> Self {
        BasicBlock {
            conv1: conv(in_channels, width, 3, stride, device),
            bn1: BatchNormConfig::new(width).init(device),
            conv2: conv(width, width, 3, 1, device),
            bn2: BatchNormConfig::new(width).init(device),
            downsample: downsample(in_channels, width, stride, device),
            with_cp: false,
        }
    }

    fn zero_last_norm(self) -> Self {
        BasicBlock {
            bn2: zeroed(self.bn2),
            ..self
        }
    }

    /// `[N, C_in, H, W]` -> `[N, width, H/s, W/s]`; the whole block one segment when `with_cp`
    /// is on (its final ReLU inside, so that its output is kept by the next segment alone).
    #[with_cp]
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let identity = skip(&self.downsample, &x);
        let y = self
            .bn1
            .forward_relu_conv(self.conv1.forward(x), &self.conv2);
        relu(self.bn2.forward(y) + identity)
    }
}

/// 1x1 reduce, 3x3, 1x1 expand by 4, and the skip (ResNet-50/101/152).
#[model]
#[derive(Module, Debug)]
pub struct Bottleneck {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    conv3: Conv2d,
    bn3: BatchNorm,
    downsample: Option<Downsample>,
    with_cp: bool,
}

impl Bottleneck {
    pub(super) fn new(
        in_channels: usize,
        width: usize,
        stride: usize,
        style: Style,
        device: &Device,
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
            with_cp: false,
        }
    }

    fn zero_last_norm(self) -> Self {
        Bottleneck {
            bn3: zeroed(self.bn3),
            ..self
        }
    }

    /// `[N, C_in, H, W]` -> `[N, 4 * width, H/s, W/s]`; the whole block one segment when
    /// `with_cp` is on.
    #[with_cp]
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let identity = skip(&self.downsample, &x);
        let y = self
            .bn1
            .forward_relu_conv(self.conv1.forward(x), &self.conv2);
        let y = self.bn2.forward_relu_conv(y, &self.conv3);
        relu(self.bn3.forward(y) + identity)
    }
}

/// A residual block of either kind.
#[allow(clippy::large_enum_variant)]
#[model]
#[derive(Module, Debug)]
pub enum Block {
    /// ResNet-18/34.
    Basic(#[with_cp] BasicBlock),
    /// ResNet-50/101/152.
    Bottleneck(#[with_cp] Bottleneck),
}

impl Block {
    /// The block's forward.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        match self {
            Block::Basic(block) => block.forward(x),
            Block::Bottleneck(block) => block.forward(x),
        }
    }

    pub(super) fn zero_last_norm(self) -> Self {
        match self {
            Block::Basic(block) => Block::Basic(block.zero_last_norm()),
            Block::Bottleneck(block) => Block::Bottleneck(block.zero_last_norm()),
        }
    }

    pub(super) fn norm_eval(self) -> Self {
        match self {
            Block::Basic(block) => Block::Basic(BasicBlock {
                bn1: block.bn1.with_eval(true),
                bn2: block.bn2.with_eval(true),
                downsample: block.downsample.map(Downsample::norm_eval),
                ..block
            }),
            Block::Bottleneck(block) => Block::Bottleneck(Bottleneck {
                bn1: block.bn1.with_eval(true),
                bn2: block.bn2.with_eval(true),
                bn3: block.bn3.with_eval(true),
                downsample: block.downsample.map(Downsample::norm_eval),
                ..block
            }),
        }
    }
}
