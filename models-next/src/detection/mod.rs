//! Object detection on Burn 0.22: RetinaNet (Lin et al., 2017) with a ResNet-FPN backbone, as
//! MMDetection 2.x builds it, ported from `memsave-models` in the same small named pieces:
//! boxes, anchors, the box coder, the assigner, the losses, the neck, the head, the detector,
//! and the post-processing.

pub mod anchors;
pub mod assigner;
pub mod boxes;
pub mod coder;
pub mod fpn;
pub mod head;
pub mod losses;
pub mod postprocess;
pub mod retinanet;

use burn::prelude::*;

use boxes::BBox;

/// What the pipeline did to an image (MMDetection's `img_meta`).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageMeta {
    /// The image's id (VOC: the file stem, `000001`).
    pub id: String,
    /// `[height, width]` as read.
    pub ori_shape: [usize; 2],
    /// `[height, width]` after resizing.
    pub img_shape: [usize; 2],
    /// `[height, width]` after padding to the size divisor (the batch may pad further).
    pub pad_shape: [usize; 2],
    /// `[w_scale, h_scale]`: resized = original x scale.
    pub scale_factor: [f32; 2],
    /// Flipped left-right.
    pub flip: bool,
}

/// Images and their annotations, in the resized images' pixels.
#[derive(Clone, Debug)]
pub struct DetectionBatch {
    /// `[N, 3, H, W]`, normalised, padded to a common size.
    pub images: Tensor<4>,
    /// Per image.
    pub metas: Vec<ImageMeta>,
    /// Per image, its boxes for training (difficult objects left out).
    pub gt_bboxes: Vec<Vec<BBox>>,
    /// Per image, the class of each box, in `0..num_classes`.
    pub gt_labels: Vec<Vec<usize>>,
}

/// One detected object, in the original image's pixels.
#[derive(Clone, Debug, PartialEq)]
pub struct Detection {
    /// `[x1, y1, x2, y2]`.
    pub bbox: BBox,
    /// Sigmoid score.
    pub score: f32,
    /// Class in `0..num_classes`.
    pub label: usize,
}
