//! The ResNet's modules: the stem, the downsample, the basic block and the bottleneck, and the
//! block that is either.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::MaxPool2d;
use burn::nn::PaddingConfig2d;
use burn::prelude::{Backend, Tensor};

use super::Style;
use crate::memsave;
use memsave::checkpoint::HasWithCp;
use memsave::nn::{conv2d, BatchNorm, BatchNormConfig, Relu};
use memsave::with_cp;

/// A `k x k` convolution without bias, padded to keep the size at stride 1.
pub(super) fn conv<B: Backend>(
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
    pub(super) conv: Conv2d<B>,
    pub(super) bn: BatchNorm<B>,
    pub(super) relu: Relu,
    pub(super) pool: MaxPool2d,
}

impl<B: Backend> Stem<B> {
    /// `[N, C, H, W]` -> `[N, base_channels, H/4, W/4]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.bn
            .forward_relu_max_pool(conv2d(&self.conv, x), &self.pool)
    }

    pub(super) fn norm_eval(self) -> Self {
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
    pub(super) fn new(
        in_channels: usize,
        out_channels: usize,
        stride: usize,
        device: &B::Device,
    ) -> Self {
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

    pub(super) fn norm_eval(self) -> Self {
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
    pub(super) fn new(in_channels: usize, width: usize, stride: usize, device: &B::Device) -> Self {
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

    pub(super) fn norm_eval(self) -> Self {
        BasicBlock {
            bn1: self.bn1.with_eval(true),
            bn2: self.bn2.with_eval(true),
            downsample: self.downsample.map(Downsample::norm_eval),
            ..self
        }
    }

    pub(super) fn zero_last_norm(self) -> Self {
        BasicBlock {
            bn2: zeroed(self.bn2),
            ..self
        }
    }
}

impl<B: memsave::Backend> BasicBlock<B> {
    /// `[N, C_in, H, W]` -> `[N, width, H/s, W/s]`; the whole block one segment when `with_cp`
    /// is on.
    #[with_cp]
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.relu.forward(self.residual(x))
    }

    /// Everything but the final ReLU.
    fn residual(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let identity = skip(&self.downsample, &x);
        // Each BN-ReLU and the conv after it are one op keeping only the BN's input.
        let y = self
            .bn1
            .forward_relu_conv(conv2d(&self.conv1, x), &self.conv2);
        memsave::nn::add(self.bn2.forward(y), identity)
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
    pub(super) fn new(
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

    pub(super) fn norm_eval(self) -> Self {
        Bottleneck {
            bn1: self.bn1.with_eval(true),
            bn2: self.bn2.with_eval(true),
            bn3: self.bn3.with_eval(true),
            downsample: self.downsample.map(Downsample::norm_eval),
            ..self
        }
    }

    pub(super) fn zero_last_norm(self) -> Self {
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
    /// `[N, C_in, H, W]` -> `[N, 4 * width, H/s, W/s]`; the whole block one segment when
    /// `with_cp` is on. MMCV leaves the final ReLU outside its checkpointed part; here it is
    /// inside, so that the block's output (the next block's input) is kept by the next segment
    /// alone, not also by the ReLU's backward: activation offload can then move it to the host
    /// (`[offload] activations`). The arithmetic is the same.
    #[with_cp]
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.relu.forward(self.residual(x))
    }

    /// conv1..bn3, the downsample and the residual add.
    fn residual(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let identity = skip(&self.downsample, &x);
        // Each BN-ReLU and the conv after it are one op keeping only the BN's input.
        let y = self
            .bn1
            .forward_relu_conv(conv2d(&self.conv1, x), &self.conv2);
        let y = self.bn2.forward_relu_conv(y, &self.conv3);
        memsave::nn::add(self.bn3.forward(y), identity)
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
    pub(super) fn norm_eval(self) -> Self {
        match self {
            Block::Basic(block) => Block::Basic(block.norm_eval()),
            Block::Bottleneck(block) => Block::Bottleneck(block.norm_eval()),
        }
    }

    pub(super) fn zero_last_norm(self) -> Self {
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
