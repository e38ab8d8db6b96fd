//! ResNet (He et al. 2016) as an MMDetection backbone: it returns the feature maps of the stages
//! in `out_indices` (C2..C5), with MMDetection's `frozen_stages`, `norm_eval`, `style`
//! (`pytorch`: stride on the 3x3 conv; `caffe`: on the first 1x1), `zero_init_residual`,
//! `base_channels` and `init_cfg` (torchvision weights, see [`crate::weights`]).
//!
//! Built with memsave's DSL: `#[with_cp]` marks every stage, so `with_cp = true` checkpoints
//! every block (MMCV's `with_cp`); unlike MMCV, `BasicBlock` supports it too. The stem takes the
//! image and is never checkpointed; a frozen stage is not either (its input does not require
//! grad: MMCV's guard runs it as written).

mod blocks;
mod config;

use burn::module::Module;
use burn::nn::pool::MaxPool2dConfig;
use burn::nn::PaddingConfig2d;
use burn::prelude::{Backend, Tensor};

use crate::memsave;
use memsave::auto_fp16;
use memsave::fp16::Fp16;
use memsave::memory;
use memsave::nn::{BatchNormConfig, Relu};

pub use blocks::{BasicBlock, Block, Bottleneck, Downsample, Stem};
use config::BlockKind;
pub use config::{BackboneType, InitCfg, ResNetConfig, Style};

impl ResNetConfig {
    /// The network: random weights (Kaiming-uniform convolutions, BN at 1 and 0, the last BN
    /// of each block at 0 with `zero_init_residual`), or the weights of `init_cfg`; then the
    /// frozen stages and `norm_eval` applied, and `with_cp` set.
    pub fn init<B: Backend>(&self, device: &B::Device) -> memsave::Result<ResNet<B>> {
        let (blocks, kind) = self.layout()?;
        self.check()?;
        let base = self.base_channels;
        let stem = Stem {
            conv: blocks::conv(self.in_channels, base, 7, 2, device),
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
