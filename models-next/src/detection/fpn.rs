//! Feature Pyramid Network (Lin et al., 2017) as MMDetection's `FPN`: 1x1 lateral convs, a
//! top-down path with nearest upsampling, 3x3 output convs, and extra levels by stride-2
//! convs (RetinaNet: P6 and P7 from C5, `add_extra_convs = "on_input"`).

use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Initializer, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::module::{interpolate, max_pool2d};
use burn::tensor::ops::{InterpolateMode, InterpolateOptions, MaxPoolOptions};
use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use crate::memsave::fp16::Fp16;
use crate::memsave::nn::relu;
use crate::memsave::{Error, Result};
use memsave_macros::{auto_fp16, with_cp};

/// Where the extra levels' first conv reads from (MMDetection's `add_extra_convs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExtraConvs {
    /// The last backbone feature map used (C5): RetinaNet.
    OnInput,
    /// The last lateral (before its 3x3 conv).
    OnLateral,
    /// The last output (P5).
    OnOutput,
}

/// `add_extra_convs`: `false` (extra levels by max pooling) or where the convs read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum AddExtraConvs {
    /// `false`: a 1x1 max pool of stride 2 for each extra level (`true` is not accepted:
    /// MMDetection reads it as `on_input`, say so).
    Off(bool),
    /// Convs reading from here.
    On(ExtraConvs),
}

/// `[model.neck]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct FpnConfig {
    /// `"FPN"`.
    #[serde(rename = "type")]
    #[default("FPN".to_string())]
    pub kind: String,
    /// Channels of each backbone feature map (C2..C5).
    #[default(vec![256, 512, 1024, 2048])]
    pub in_channels: Vec<usize>,
    /// Channels of every output level.
    #[default(256)]
    pub out_channels: usize,
    /// The first backbone level used (1: C3, for P3).
    #[default(1)]
    pub start_level: usize,
    /// The extra levels' source.
    #[default(AddExtraConvs::On(ExtraConvs::OnInput))]
    pub add_extra_convs: AddExtraConvs,
    /// Output levels in all (RetinaNet: 5, P3..P7).
    #[default(5)]
    pub num_outs: usize,
    /// ReLU before each extra conv (RetinaNet: no).
    pub relu_before_extra_convs: bool,
    /// Recompute the whole pyramid in backward (one segment: it keeps the backbone levels it
    /// reads, which the backbone's checkpointed blocks keep anyway, and none of its laterals,
    /// sums or outputs). Beyond MMDetection, whose FPN has no `with_cp`.
    pub with_cp: bool,
}

fn conv(channels: [usize; 2], kernel: usize, stride: usize, device: &Device) -> Conv2d {
    let pad = kernel / 2;
    let mut conv = Conv2dConfig::new(channels, [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .with_initializer(Initializer::XavierUniform { gain: 1.0 })
        .init(device);
    conv.bias = Some(Param::from_tensor(Tensor::zeros([channels[1]], device)));
    conv
}

impl FpnConfig {
    /// Checks the values; errors name the field.
    pub fn check(&self) -> Result<()> {
        let bad = |field: &str, message: String| Err(Error::invalid(field, message));
        if self.kind != "FPN" {
            return bad("type", format!("`{}` is not known: use \"FPN\"", self.kind));
        }
        if self.in_channels.is_empty() || self.in_channels.contains(&0) {
            return bad(
                "in_channels",
                format!("must be positive, got {:?}", self.in_channels),
            );
        }
        if self.out_channels == 0 {
            return bad("out_channels", "must be at least 1".to_string());
        }
        if self.start_level >= self.in_channels.len() {
            return bad(
                "start_level",
                format!(
                    "{} is past the {} inputs",
                    self.start_level,
                    self.in_channels.len()
                ),
            );
        }
        let used = self.in_channels.len() - self.start_level;
        if self.num_outs < used {
            return bad(
                "num_outs",
                format!(
                    "{} is fewer than the {used} levels used from the backbone",
                    self.num_outs
                ),
            );
        }
        if self.add_extra_convs == AddExtraConvs::Off(true) {
            return bad(
                "add_extra_convs",
                "say where the extra convs read from: \"on_input\", \"on_lateral\" or \"on_output\" (or false)"
                    .to_string(),
            );
        }
        Ok(())
    }

    /// The neck, Xavier-uniform weights and zero biases.
    pub fn init(&self, device: &Device) -> Result<Fpn> {
        self.check()?;
        let used = &self.in_channels[self.start_level..];
        let out = self.out_channels;
        let lateral_convs = used.iter().map(|&c| conv([c, out], 1, 1, device)).collect();
        let fpn_convs = used
            .iter()
            .map(|_| conv([out, out], 3, 1, device))
            .collect();
        let extra = self.num_outs - used.len();
        let extra_convs = match self.add_extra_convs {
            AddExtraConvs::Off(_) => Vec::new(),
            AddExtraConvs::On(source) => (0..extra)
                .map(|i| {
                    let input = if i == 0 && source == ExtraConvs::OnInput {
                        *used.last().expect("checked: at least one level")
                    } else {
                        out
                    };
                    conv([input, out], 3, 2, device)
                })
                .collect(),
        };
        Ok(Fpn {
            lateral_convs,
            fpn_convs,
            extra_convs,
            start_level: self.start_level,
            num_outs: self.num_outs,
            source: match self.add_extra_convs {
                AddExtraConvs::On(ExtraConvs::OnLateral) => 1,
                AddExtraConvs::On(ExtraConvs::OnOutput) => 2,
                _ => 0,
            },
            relu_before_extra_convs: self.relu_before_extra_convs,
            with_cp: self.with_cp,
            fp16_enabled: Fp16::Off,
        })
    }
}

/// The feature pyramid.
#[memsave_macros::model]
#[derive(Module, Debug)]
pub struct Fpn {
    lateral_convs: Vec<Conv2d>,
    fpn_convs: Vec<Conv2d>,
    extra_convs: Vec<Conv2d>,
    start_level: usize,
    num_outs: usize,
    /// 0: on input, 1: on lateral, 2: on output.
    source: usize,
    relu_before_extra_convs: bool,
    with_cp: bool,
    fp16_enabled: Fp16,
}

impl Fpn {
    /// Backbone feature maps (all of them, C2..C5) -> `num_outs` maps of `out_channels`,
    /// strides doubling from the first used level's.
    #[auto_fp16]
    pub fn forward(&self, inputs: Vec<Tensor<4>>) -> Vec<Tensor<4>> {
        // Only the levels used cross into the segment: a checkpointed pyramid keeps no others.
        let mut inputs = inputs;
        let used = inputs.split_off(self.start_level.min(inputs.len()));
        let last_input = used.last().cloned();
        let (mut outs, last_lateral) = self.pyramid(used);
        if self.extra_convs.is_empty() {
            while outs.len() < self.num_outs {
                let last = outs.last().expect("at least one level").clone();
                outs.push(max_pool2d(
                    last,
                    MaxPoolOptions::new([1, 1]).with_stride([2, 2]),
                ));
            }
            return outs;
        }
        // The extra levels (a quarter of the last level's area and less) run outside the
        // segment: a tensor that three ops read (P6: the head's two branches and P7's conv)
        // then has its gradients summed in the same order with and without checkpointing.
        let mut x = match self.source {
            0 => last_input.expect("at least one level"),
            1 => last_lateral.expect("the pyramid returns its last lateral"),
            _ => outs.last().expect("at least one level").clone(),
        };
        for (i, conv) in self.extra_convs.iter().enumerate() {
            // MMDetection: the first extra conv reads its source as it is.
            if i > 0 && self.relu_before_extra_convs {
                x = relu(x);
            }
            x = conv.forward(x);
            outs.push(x.clone());
        }
        outs
    }

    /// The used levels (C3..C5 for RetinaNet) -> their outputs (P3..P5), and the last lateral
    /// where the extra levels read it; one segment when `with_cp` is on.
    #[with_cp]
    fn pyramid(&self, used: Vec<Tensor<4>>) -> (Vec<Tensor<4>>, Option<Tensor<4>>) {
        let mut laterals: Vec<Tensor<4>> = self
            .lateral_convs
            .iter()
            .zip(used)
            .map(|(conv, x)| conv.forward(x))
            .collect();
        for i in (1..laterals.len()).rev() {
            let [_, _, h, w] = laterals[i - 1].dims();
            let up = interpolate(
                laterals[i].clone(),
                InterpolateOptions::new(InterpolateMode::Nearest).with_output_size([h, w]),
            );
            laterals[i - 1] = laterals[i - 1].clone() + up;
        }
        let last_lateral = if self.source == 1 && !self.extra_convs.is_empty() {
            laterals.last().cloned()
        } else {
            None
        };
        let outs = self
            .fpn_convs
            .iter()
            .zip(laterals)
            .map(|(conv, x)| conv.forward(x))
            .collect();
        (outs, last_lateral)
    }
}
