//! ResNet (torchvision's and MMDetection's) on Burn 0.22: the stem, four stages of basic blocks
//! (ResNet-18/34) or bottlenecks (ResNet-50/101/152), each block one `#[with_cp]` segment, the
//! features of the stages `out_indices` names.

mod blocks;
mod config;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::pool::MaxPool2dConfig;
use burn::nn::PaddingConfig2d;
use burn::prelude::*;
use memsave_macros::{auto_fp16, model};
use memsave_next::fp16::Fp16;
use memsave_next::memory;
use memsave_next::nn::BatchNormConfig;
use memsave_next::{Error, Result};

pub use blocks::{BasicBlock, Block, Bottleneck, Downsample, Stem};
pub use config::{BackboneType, InitCfg, ResNetConfig, Style};

/// The kind of block, and how many a stage has, by depth.
fn layout(depth: usize) -> Result<(bool, [usize; 4])> {
    Ok(match depth {
        18 => (false, [2, 2, 2, 2]),
        34 => (false, [3, 4, 6, 3]),
        50 => (true, [3, 4, 6, 3]),
        101 => (true, [3, 4, 23, 3]),
        152 => (true, [3, 8, 36, 3]),
        other => {
            return Err(Error::invalid(
                "depth",
                format!("a ResNet is 18, 34, 50, 101 or 152 deep, got {other}"),
            ))
        }
    })
}

impl ResNetConfig {
    /// The network on `device`; an error names a setting out of range.
    pub fn init(&self, device: &Device) -> Result<ResNet> {
        let (bottleneck, counts) = layout(self.depth)?;
        self.check()?;
        let base = self.base_channels;
        let stem = Stem {
            conv: blocks::conv(self.in_channels, base, 7, 2, device),
            bn: BatchNormConfig::new(base).init(device),
            pool: MaxPool2dConfig::new([3, 3])
                .with_strides([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(),
        };
        let mut in_channels = base;
        let mut stages = Vec::with_capacity(4);
        for (stage, &count) in counts.iter().enumerate() {
            let width = base << stage;
            let mut layer = Vec::with_capacity(count);
            for index in 0..count {
                let stride = if stage > 0 && index == 0 { 2 } else { 1 };
                let block = if bottleneck {
                    Block::Bottleneck(Bottleneck::new(
                        in_channels,
                        width,
                        stride,
                        self.style,
                        device,
                    ))
                } else {
                    Block::Basic(BasicBlock::new(in_channels, width, stride, device))
                };
                let block = if self.zero_init_residual {
                    block.zero_last_norm()
                } else {
                    block
                };
                in_channels = width * if bottleneck { 4 } else { 1 };
                layer.push(block);
            }
            stages.push(layer);
        }
        let mut stages = stages.into_iter();
        let mut next = || stages.next().expect("four stages were built");
        let mut resnet = initialized(ResNet {
            stem,
            layer1: next(),
            layer2: next(),
            layer3: next(),
            layer4: next(),
            out_indices: self.out_indices.clone(),
            fp16_enabled: Fp16::Off,
        });
        if let Some(InitCfg::Pretrained { checkpoint }) = &self.init_cfg {
            resnet = crate::weights::load_torchvision_resnet(resnet, checkpoint)?;
        }
        if self.norm_eval {
            resnet = resnet.norm_eval();
        }
        resnet = resnet.freeze_stages(self.frozen_stages);
        Ok(memsave_next::checkpoint::set_with_cp(
            resnet,
            self.with_cp.starts_on(),
        ))
    }
}

/// `model` with every parameter initialized now, in its visiting order (torchvision's eager
/// initialization). Burn 0.22 initializes a parameter on its first use, from the random
/// stream of that moment: the weights would then depend on the order of first uses, which a
/// checkpointed block changes (its segment initializes its parameters in visiting order), and
/// on what drew from the stream before.
pub(crate) fn initialized<M: Module>(model: M) -> M {
    struct Read;
    impl ModuleVisitor for Read {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            drop(param.val());
        }
    }
    model.visit(&mut Read);
    model
}

/// A ResNet: the stem and four stages of blocks, each block a segment (`with_cp` per block,
/// `memsave_next::checkpoint::set_with_cp` for all).
#[model]
#[derive(Module, Debug)]
pub struct ResNet {
    stem: Stem,
    #[with_cp]
    layer1: Vec<Block>,
    #[with_cp]
    layer2: Vec<Block>,
    #[with_cp]
    layer3: Vec<Block>,
    #[with_cp]
    layer4: Vec<Block>,
    #[module(skip)]
    out_indices: Vec<usize>,
    fp16_enabled: Fp16,
}

impl ResNet {
    /// `[N, C, H, W]` -> the features of the stages in `out_indices`, in order (stage `i`:
    /// `[N, base * 2^i * expansion, H / 2^(i+2), W / 2^(i+2)]`). Each block runs under a
    /// memory scope of its name (`layer3.2`), the stem under `stem`.
    #[auto_fp16]
    pub fn forward(&self, images: Tensor<4>) -> Vec<Tensor<4>> {
        let mut x = memory::scope("stem", || self.stem.forward(images));
        let last = self.out_indices.iter().copied().max().unwrap_or(3);
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

    /// Every BatchNorm in eval mode during training (MMDetection's `norm_eval`): the running
    /// statistics normalise and stay as they are; the norms' weights still train unless frozen.
    pub fn norm_eval(self) -> Self {
        let eval = |layer: Vec<Block>| layer.into_iter().map(Block::norm_eval).collect();
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
    /// parameters, their BatchNorms in eval mode (MMDetection's `frozen_stages`; -1 freezes
    /// nothing). Frozen weights are what `frozen_dtype` holds compressed.
    pub fn freeze_stages(self, stages: i64) -> Self {
        let frozen = |stage: i64| stages >= stage;
        let freeze = |layer: Vec<Block>, stage: i64| -> Vec<Block> {
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

    /// The number of blocks, stage by stage.
    pub fn blocks(&self) -> [usize; 4] {
        [
            self.layer1.len(),
            self.layer2.len(),
            self.layer3.len(),
            self.layer4.len(),
        ]
    }
}
