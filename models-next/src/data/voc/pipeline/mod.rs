//! MMDetection's data pipeline for detection, as a list of named steps in the config
//! (`LoadImageFromFile`, `LoadAnnotations`, `Resize`, `RandomFlip`, `Normalize`, `Pad`,
//! `DefaultFormatBundle`, `Collect`, and for testing `MultiScaleFlipAug` with `ImageToTensor`),
//! compiled into one [`Pipeline`] that decodes, resizes keeping the ratio, flips, normalises
//! and pads an image.

use image::imageops::FilterType;
use serde::{Deserialize, Serialize};

use super::VocImage;
use crate::detection::boxes::BBox;
use crate::detection::ImageMeta;
use crate::memsave::{Error, Result};

/// One step of `pipeline`, by MMDetection's `type`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum Step {
    /// Decode the image.
    LoadImageFromFile {},
    /// Read the boxes.
    LoadAnnotations {
        /// Boxes (the only kind here).
        #[serde(default = "yes")]
        with_bbox: bool,
    },
    /// Rescale.
    Resize {
        /// `[long, short]` edge limits, e.g. `[1000, 600]`; or a list of them,
        /// `[[1333, 640], [1333, 800]]`, for multi-scale training (see `multiscale_mode`).
        img_scale: ImgScale,
        /// Keep the aspect ratio (scale to fit both limits), else stretch to `img_scale`.
        #[serde(default = "yes")]
        keep_ratio: bool,
        /// With a list of scales: `"range"` (MMDetection's default: each image's long and short
        /// edges drawn uniformly between the two scales') or `"value"` (one of the scales,
        /// drawn per image).
        #[serde(default)]
        multiscale_mode: Option<String>,
    },
    /// Horizontal flip with a probability.
    RandomFlip {
        /// Probability of a flip (training); absent in testing.
        #[serde(default)]
        flip_ratio: Option<f32>,
    },
    /// `(pixel - mean) / std` per channel.
    Normalize {
        /// Per channel.
        mean: [f32; 3],
        /// Per channel.
        std: [f32; 3],
        /// The mean and std are in RGB order (images decode as RGB).
        #[serde(default = "yes")]
        to_rgb: bool,
    },
    /// Pad bottom and right to a multiple.
    Pad {
        /// The multiple.
        size_divisor: usize,
    },
    /// Batch formatting (no settings).
    DefaultFormatBundle {},
    /// Image to tensor (testing; no settings).
    ImageToTensor {
        /// The keys (`["img"]`).
        #[serde(default)]
        keys: Vec<String>,
    },
    /// Which results reach the model (no effect: images and boxes always do).
    Collect {
        /// The keys.
        #[serde(default)]
        keys: Vec<String>,
    },
    /// Testing's wrapper: one scale, no flip.
    MultiScaleFlipAug {
        /// `[long, short]`.
        img_scale: [usize; 2],
        /// Test-time flip (not supported: false).
        #[serde(default)]
        flip: bool,
        /// The steps inside.
        transforms: Vec<Step>,
    },
}

fn yes() -> bool {
    true
}

/// `Resize`'s `img_scale`: one `[long, short]`, or several.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ImgScale {
    /// One scale.
    One([usize; 2]),
    /// Several (multi-scale training).
    Many(Vec<[usize; 2]>),
}

impl ImgScale {
    fn scales(&self) -> Vec<[usize; 2]> {
        match self {
            ImgScale::One(scale) => vec![*scale],
            ImgScale::Many(scales) => scales.clone(),
        }
    }
}

/// How an image's scale is drawn from several (MMDetection 2.x `Resize`'s `multiscale_mode`).
#[derive(Clone, Debug, PartialEq)]
pub enum MultiScale {
    /// One scale: `img_scale`.
    Single,
    /// The long and the short edge each drawn uniformly (integers, both ends included) between
    /// the two scales' long edges and short edges.
    Range([[usize; 2]; 2]),
    /// One of the scales, uniformly.
    Value(Vec<[usize; 2]>),
}

/// `Resize`'s scales and mode, checked: the largest scale (long and short edges) and how each
/// image's is drawn. `at` names the step in errors.
fn multiscale(
    img_scale: &ImgScale,
    mode: Option<&str>,
    at: &str,
) -> Result<([usize; 2], MultiScale)> {
    let scales = img_scale.scales();
    if scales.is_empty() {
        return Err(Error::invalid(
            format!("{at}.img_scale"),
            "is an empty list: give `[long, short]` or a list of them",
        ));
    }
    if let Some(zero) = scales.iter().find(|s| s.contains(&0)) {
        return Err(Error::invalid(
            format!("{at}.img_scale"),
            format!("{zero:?} has a zero"),
        ));
    }
    let largest = [
        scales.iter().map(|s| s[0].max(s[1])).max().unwrap_or(0),
        scales.iter().map(|s| s[0].min(s[1])).max().unwrap_or(0),
    ];
    let mode = match mode {
        None | Some("range") => "range",
        Some("value") => "value",
        Some(other) => {
            return Err(Error::invalid(
                format!("{at}.multiscale_mode"),
                format!("`{other}` is not a mode: \"range\" or \"value\""),
            ))
        }
    };
    let multiscale = match (scales.len(), mode) {
        (1, _) => return Ok((scales[0], MultiScale::Single)),
        (2, "range") => MultiScale::Range([scales[0], scales[1]]),
        (n, "range") => {
            return Err(Error::invalid(
                format!("{at}.img_scale"),
                format!(
                    "multiscale_mode = \"range\" draws between two scales, and {n} are given: \
                     give two, or set multiscale_mode = \"value\" to draw one of them"
                ),
            ))
        }
        _ => MultiScale::Value(scales),
    };
    Ok((largest, multiscale))
}

/// What a pipeline does to an image, in one place.
#[derive(Clone, Debug, PartialEq)]
pub struct Pipeline {
    /// `[long, short]` limits; under multi-scale training, the largest long and short edges
    /// of the scales (the largest image the pipeline makes).
    pub img_scale: [usize; 2],
    /// How each image's scale is drawn.
    pub multiscale: MultiScale,
    /// Keep the ratio.
    pub keep_ratio: bool,
    /// Probability of a horizontal flip.
    pub flip_ratio: f32,
    /// Per channel, RGB.
    pub mean: [f32; 3],
    /// Per channel, RGB.
    pub std: [f32; 3],
    /// Pad to a multiple of this.
    pub size_divisor: usize,
}

impl Pipeline {
    /// MMDetection's VOC training pipeline at `img_scale` (flip 0.5, ImageNet mean and std,
    /// pad to 32).
    pub fn train(img_scale: [usize; 2]) -> Self {
        Pipeline {
            img_scale,
            multiscale: MultiScale::Single,
            keep_ratio: true,
            flip_ratio: 0.5,
            mean: [123.675, 116.28, 103.53],
            std: [58.395, 57.12, 57.375],
            size_divisor: 32,
        }
    }

    /// The test pipeline: the same without flipping.
    pub fn test(img_scale: [usize; 2]) -> Self {
        Pipeline {
            flip_ratio: 0.0,
            ..Self::train(img_scale)
        }
    }

    /// Compiles MMDetection's step list; `field` (`data.train.pipeline`) names it in errors.
    pub fn from_steps(steps: &[Step], field: &str) -> Result<Self> {
        let mut pipeline = Pipeline {
            img_scale: [0, 0],
            flip_ratio: 0.0,
            ..Self::train([1000, 600])
        };
        let (mut resized, mut normalised, mut loaded) = (false, false, false);
        fn walk(
            steps: &[Step],
            p: &mut Pipeline,
            flags: (&mut bool, &mut bool, &mut bool),
            field: &str,
        ) -> Result<()> {
            let (resized, normalised, loaded) = flags;
            for (k, step) in steps.iter().enumerate() {
                let at = format!("{field}[{k}]");
                match step {
                    Step::LoadImageFromFile {} => *loaded = true,
                    Step::LoadAnnotations { with_bbox } => {
                        if !with_bbox {
                            return Err(Error::invalid(
                                format!("{at}.with_bbox"),
                                "a detector needs its boxes: true",
                            ));
                        }
                    }
                    Step::Resize {
                        img_scale,
                        keep_ratio,
                        multiscale_mode,
                    } => {
                        let (scale, multiscale) =
                            multiscale(img_scale, multiscale_mode.as_deref(), &at)?;
                        p.img_scale = scale;
                        p.multiscale = multiscale;
                        p.keep_ratio = *keep_ratio;
                        *resized = true;
                    }
                    Step::RandomFlip { flip_ratio } => {
                        let ratio = flip_ratio.unwrap_or(0.0);
                        if !(0.0..=1.0).contains(&ratio) {
                            return Err(Error::invalid(
                                format!("{at}.flip_ratio"),
                                format!("must be in [0, 1], got {ratio}"),
                            ));
                        }
                        p.flip_ratio = ratio;
                    }
                    Step::Normalize { mean, std, to_rgb } => {
                        if std.iter().any(|s| !(*s > 0.0)) {
                            return Err(Error::invalid(
                                format!("{at}.std"),
                                format!("must be positive, got {std:?}"),
                            ));
                        }
                        // Images decode as RGB; BGR statistics are reversed to match.
                        let (mut m, mut s) = (*mean, *std);
                        if !to_rgb {
                            m.reverse();
                            s.reverse();
                        }
                        p.mean = m;
                        p.std = s;
                        *normalised = true;
                    }
                    Step::Pad { size_divisor } => {
                        if *size_divisor == 0 {
                            return Err(Error::invalid(
                                format!("{at}.size_divisor"),
                                "must be at least 1",
                            ));
                        }
                        p.size_divisor = *size_divisor;
                    }
                    Step::DefaultFormatBundle {}
                    | Step::ImageToTensor { .. }
                    | Step::Collect { .. } => {}
                    Step::MultiScaleFlipAug {
                        img_scale,
                        flip,
                        transforms,
                    } => {
                        if *flip {
                            return Err(Error::invalid(
                                format!("{at}.flip"),
                                "test-time flipping is not supported: false",
                            ));
                        }
                        walk(
                            transforms,
                            p,
                            (&mut *resized, &mut *normalised, &mut *loaded),
                            &format!("{at}.transforms"),
                        )?;
                        p.img_scale = *img_scale;
                        p.multiscale = MultiScale::Single;
                        *resized = true;
                    }
                }
            }
            Ok(())
        }
        walk(
            steps,
            &mut pipeline,
            (&mut resized, &mut normalised, &mut loaded),
            field,
        )?;
        let missing = [
            (loaded, "LoadImageFromFile"),
            (resized, "Resize"),
            (normalised, "Normalize"),
        ]
        .iter()
        .filter(|(done, _)| !done)
        .map(|(_, name)| *name)
        .collect::<Vec<_>>();
        if !missing.is_empty() {
            return Err(Error::invalid(
                field,
                format!("has no {} step", missing.join(", no ")),
            ));
        }
        if pipeline.img_scale.contains(&0) {
            return Err(Error::invalid(
                field,
                "the test pipeline needs MultiScaleFlipAug's img_scale",
            ));
        }
        Ok(pipeline)
    }

    /// The scale of one image: `img_scale`, or under multi-scale training one drawn by
    /// `uniform(n)` (a uniform integer below `n`) as `multiscale_mode` says.
    pub fn draw_scale(&self, mut uniform: impl FnMut(usize) -> usize) -> [usize; 2] {
        match &self.multiscale {
            MultiScale::Single => self.img_scale,
            MultiScale::Range([a, b]) => {
                let edge = |x: usize, y: usize, uniform: &mut dyn FnMut(usize) -> usize| {
                    let (low, high) = (x.min(y), x.max(y));
                    low + uniform(high - low + 1)
                };
                let (long_a, short_a) = (a[0].max(a[1]), a[0].min(a[1]));
                let (long_b, short_b) = (b[0].max(b[1]), b[0].min(b[1]));
                let long = edge(long_a, long_b, &mut uniform);
                let short = edge(short_a, short_b, &mut uniform);
                [long, short]
            }
            MultiScale::Value(scales) => scales[uniform(scales.len()).min(scales.len() - 1)],
        }
    }

    /// The size an image of `[height, width]` is resized to, and the scale factors
    /// `[w_scale, h_scale]` (mmcv's `imrescale`: the largest that fits both limits, sides
    /// rounded).
    pub fn resized_shape(&self, shape: [usize; 2]) -> ([usize; 2], [f32; 2]) {
        self.resized_shape_at(shape, self.img_scale)
    }

    /// [`Pipeline::resized_shape`] at the scale `img_scale`.
    pub fn resized_shape_at(
        &self,
        [height, width]: [usize; 2],
        img_scale: [usize; 2],
    ) -> ([usize; 2], [f32; 2]) {
        let (h, w) = (height as f32, width as f32);
        let (new_h, new_w) = if self.keep_ratio {
            let (long, short) = (
                img_scale[0].max(img_scale[1]) as f32,
                img_scale[0].min(img_scale[1]) as f32,
            );
            let factor = (long / h.max(w)).min(short / h.min(w));
            (
                ((h * factor) + 0.5).floor() as usize,
                ((w * factor) + 0.5).floor() as usize,
            )
        } else {
            (img_scale[1], img_scale[0])
        };
        let (new_h, new_w) = (new_h.max(1), new_w.max(1));
        ([new_h, new_w], [new_w as f32 / w, new_h as f32 / h])
    }

    /// Runs the pipeline on `image`: `[3, H, W]` normalised pixels padded to the divisor (RGB,
    /// channel-major), its meta, and its boxes (difficult ones left out) and labels in the
    /// resized image's pixels. `flip` decides the flip (the loader draws it).
    pub fn apply(
        &self,
        image: &VocImage,
        flip: bool,
    ) -> Result<(Vec<f32>, ImageMeta, Vec<BBox>, Vec<usize>)> {
        self.apply_at(image, flip, self.img_scale)
    }

    /// [`Pipeline::apply`] at the scale `img_scale` (one [`Pipeline::draw_scale`] drew).
    pub fn apply_at(
        &self,
        image: &VocImage,
        flip: bool,
        img_scale: [usize; 2],
    ) -> Result<(Vec<f32>, ImageMeta, Vec<BBox>, Vec<usize>)> {
        let decoded = decode(image)?.to_rgb8();
        let (width, height) = decoded.dimensions();
        same_size(image, width, height)?;
        let ([new_h, new_w], [ws, hs]) =
            self.resized_shape_at([height as usize, width as usize], img_scale);
        let mut resized =
            image::imageops::resize(&decoded, new_w as u32, new_h as u32, FilterType::Triangle);
        if flip {
            image::imageops::flip_horizontal_in_place(&mut resized);
        }
        let d = self.size_divisor;
        let (pad_h, pad_w) = (new_h.div_ceil(d) * d, new_w.div_ceil(d) * d);
        let mut pixels = vec![0.0f32; 3 * pad_h * pad_w];
        for (x, y, p) in resized.enumerate_pixels() {
            for c in 0..3 {
                pixels[(c * pad_h + y as usize) * pad_w + x as usize] =
                    (p[c] as f32 - self.mean[c]) / self.std[c];
            }
        }
        let mut boxes = Vec::new();
        let mut labels = Vec::new();
        for object in image.objects.iter().filter(|o| !o.difficult) {
            let b = object.bbox;
            let mut b = [
                (b[0] * ws).clamp(0.0, new_w as f32),
                (b[1] * hs).clamp(0.0, new_h as f32),
                (b[2] * ws).clamp(0.0, new_w as f32),
                (b[3] * hs).clamp(0.0, new_h as f32),
            ];
            if flip {
                b = [new_w as f32 - b[2], b[1], new_w as f32 - b[0], b[3]];
            }
            boxes.push(b);
            labels.push(object.label);
        }
        let meta = ImageMeta {
            id: image.id.clone(),
            ori_shape: [height as usize, width as usize],
            img_shape: [new_h, new_w],
            pad_shape: [pad_h, pad_w],
            scale_factor: [ws, hs],
            flip,
        };
        Ok((pixels, meta, boxes, labels))
    }
}

mod file;
mod multiscale;

pub use file::check_image;
use file::{decode, same_size};
pub use multiscale::MultiScaleTraining;
