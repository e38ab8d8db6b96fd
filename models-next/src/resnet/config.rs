//! The configuration of a [`super::ResNet`] on Burn 0.22: MMDetection's `backbone =
//! dict(type='ResNet', ...)`, its depths and its checks, as `memsave-models` reads it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use crate::memsave;
use memsave::planner::WithCp;

/// Configuration of a [`super::ResNet`]: MMDetection's `backbone = dict(type='ResNet',
/// depth=50, ...)`, read straight from a config's `[model.backbone]`; unset keys take the
/// defaults stated on the fields (a ResNet-50), as burn-nn's configs do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct ResNetConfig {
    /// `"ResNet"`.
    #[serde(rename = "type")]
    pub kind: BackboneType,
    /// 18, 34 (basic blocks), 50, 101 or 152 (bottlenecks).
    #[default(50)]
    pub depth: usize,
    /// Channels of the input image.
    #[default(3)]
    pub in_channels: usize,
    /// Channels of the stem, and the width of the first stage (64 in torchvision's ResNets;
    /// narrower for small models and test fixtures). Stage `i` is `base_channels << i` wide.
    #[default(64)]
    pub base_channels: usize,
    /// The stages whose feature maps `forward` returns, from 0 (C2) to 3 (C5).
    #[default(vec![0, 1, 2, 3])]
    pub out_indices: Vec<usize>,
    /// `-1`: train everything; `0`: freeze the stem; `k`: the stem and stages 1..=k
    /// (parameters take no gradient and no optimizer state, their BNs run in eval mode).
    #[default(-1)]
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
    /// torchvision ResNet state dict (`.pth` or `.safetensors`) on Burn 0.21; on Burn 0.22 it
    /// is an error until the port's loading slice (absent: random).
    pub init_cfg: Option<InitCfg>,
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

    /// With `base_channels` set.
    pub fn with_base_channels(mut self, base_channels: usize) -> Self {
        self.base_channels = base_channels;
        self
    }

    /// With `out_indices` set.
    pub fn with_out_indices(mut self, out_indices: Vec<usize>) -> Self {
        self.out_indices = out_indices;
        self
    }

    /// With `frozen_stages` set.
    pub fn with_frozen_stages(mut self, frozen_stages: i64) -> Self {
        self.frozen_stages = frozen_stages;
        self
    }

    /// With `norm_eval` set.
    pub fn with_norm_eval(mut self, norm_eval: bool) -> Self {
        self.norm_eval = norm_eval;
        self
    }

    /// With `style` set.
    pub fn with_style(mut self, style: Style) -> Self {
        self.style = style;
        self
    }

    /// With `zero_init_residual` set.
    pub fn with_zero_init_residual(mut self, zero_init_residual: bool) -> Self {
        self.zero_init_residual = zero_init_residual;
        self
    }

    /// Blocks per stage and block kind for the configured depth.
    pub(super) fn layout(&self) -> memsave::Result<([usize; 4], BlockKind)> {
        Ok(match self.depth {
            18 => ([2, 2, 2, 2], BlockKind::Basic),
            34 => ([3, 4, 6, 3], BlockKind::Basic),
            50 => ([3, 4, 6, 3], BlockKind::Bottleneck),
            101 => ([3, 4, 23, 3], BlockKind::Bottleneck),
            152 => ([3, 8, 36, 3], BlockKind::Bottleneck),
            other => {
                return Err(memsave::Error::invalid(
                    "depth",
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

    pub(super) fn check(&self) -> memsave::Result<()> {
        let bad = |field: &str, message: String| Err(memsave::Error::invalid(field, message));
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
}

#[derive(Clone, Copy)]
pub(super) enum BlockKind {
    Basic,
    Bottleneck,
}

impl BlockKind {
    pub(super) fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}
