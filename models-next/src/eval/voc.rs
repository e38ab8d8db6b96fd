//! Pascal VOC's mean average precision at IoU 0.5, as MMDetection's `eval_map` scores VOC: the
//! devkit's inclusive pixels (`+ 1` in widths, heights and overlaps), difficult objects neither
//! found nor missed, a second detection of a found object a false positive, the 11-point
//! (VOC2007) or area (VOC2010+) average precision, and classes without ground truth left out of
//! the mean.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::data::voc::{class_index, VocImage, VOC_CLASSES};
use crate::memsave::{Error, Result};

/// How a precision-recall curve becomes one number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApMode {
    /// The mean of the best precision at recall >= 0, 0.1, ..., 1 (VOC2007).
    #[serde(rename = "11points")]
    ElevenPoints,
    /// The area under the monotone precision envelope (VOC2010 and later).
    #[serde(rename = "area")]
    Area,
}

impl std::str::FromStr for ApMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "11points" => Ok(ApMode::ElevenPoints),
            "area" => Ok(ApMode::Area),
            other => Err(format!("`{other}` is not a metric: use 11points or area")),
        }
    }
}

/// One detection in a detections file: the devkit's inclusive pixels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetectionRecord {
    /// The image id (`000001`).
    pub image: String,
    /// The class name (`dog`).
    pub class: String,
    /// Confidence.
    pub score: f32,
    /// `[x1, y1, x2, y2]`.
    #[serde(rename = "box")]
    pub bbox: [f32; 4],
}

/// Reads a detections file (JSON list of [`DetectionRecord`]), checking every class name
/// and number; errors name the file and the entry.
pub fn read_detections(path: &Path) -> Result<Vec<DetectionRecord>> {
    let bad = |message: String| Error::Data(format!("{}: {message}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let records: Vec<DetectionRecord> = serde_json::from_str(&text).map_err(|e| {
        Error::data_file(
            path,
            "not a detections file ([{\"image\", \"class\", \"score\", \"box\": [x1, y1, x2, y2]}, ...])",
            e,
        )
    })?;
    for (k, r) in records.iter().enumerate() {
        if class_index(&r.class).is_none() {
            return Err(bad(format!("entry {k}: unknown class `{}`", r.class)));
        }
        if !r.score.is_finite() || r.bbox.iter().any(|v| !v.is_finite()) {
            return Err(bad(format!(
                "entry {k}: score and box must be finite numbers"
            )));
        }
    }
    Ok(records)
}

/// Writes detections as JSON, whole: into a temporary file renamed into place.
pub fn write_detections(path: &Path, records: &[DetectionRecord]) -> Result<()> {
    let text = serde_json::to_string_pretty(records)
        .map_err(|e| Error::data_file(path, "cannot write the detections", e))?;
    let partial = path.with_extension("json.partial");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    std::fs::write(&partial, text).map_err(io(&partial))?;
    std::fs::rename(&partial, path).map_err(io(path))
}

/// The score of one class.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassAp {
    /// The class name.
    pub class: &'static str,
    /// Objects that count (not difficult).
    pub num_gts: usize,
    /// Detections of the class.
    pub num_dets: usize,
    /// Recall at the lowest score.
    pub recall: f32,
    /// Average precision.
    pub ap: f32,
}

/// A detection's box must be one the devkit could score: `x1 <= x2`, `y1 <= y2`, touching the
/// image, and no farther outside it than its own size (a detector clips to the image; anything
/// else is a bug in whatever wrote the file, which the devkit would silently count as a miss).
/// The error names the entry, its image and its class.
fn check_box(k: usize, d: &DetectionRecord, image: &VocImage) -> Result<()> {
    let [x1, y1, x2, y2] = d.bbox;
    let (w, h) = (image.width as f32, image.height as f32);
    let fault = if x2 < x1 || y2 < y1 {
        Some("is inverted (x2 < x1 or y2 < y1)")
    } else if x2 < 0.0 || y2 < 0.0 || x1 > w + 1.0 || y1 > h + 1.0 {
        Some("lies wholly outside the image")
    } else if x1 < -w || y1 < -h || x2 > 2.0 * w + 1.0 || y2 > 2.0 * h + 1.0 {
        Some("reaches farther outside the image than the image's own size")
    } else {
        None
    };
    match fault {
        Some(fault) => Err(Error::Data(format!(
            "detection {k} (image `{}`, class `{}`): box {:?} {fault} ({} x {})",
            d.image, d.class, d.bbox, image.width, image.height
        ))),
        None => Ok(()),
    }
}

/// The scores of every class and their mean.
#[derive(Clone, Debug, PartialEq)]
pub struct MapResult {
    /// Per class, in VOC's order.
    pub classes: Vec<ClassAp>,
    /// The mean over classes with ground truth.
    pub map: f32,
}

impl fmt::Display for MapResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<12} {:>6} {:>6} {:>7} {:>7}",
            "class", "gts", "dets", "recall", "ap"
        )?;
        for c in &self.classes {
            writeln!(
                f,
                "{:<12} {:>6} {:>6} {:>7.4} {:>7.4}",
                c.class, c.num_gts, c.num_dets, c.recall, c.ap
            )?;
        }
        write!(f, "mAP: {:.4}", self.map)
    }
}

fn legacy_iou(a: &[f32; 4], b: &[f32; 4]) -> f32 {
    let w = (a[2].min(b[2]) - a[0].max(b[0]) + 1.0).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1]) + 1.0).max(0.0);
    let inter = w * h;
    let area = |x: &[f32; 4]| (x[2] - x[0] + 1.0) * (x[3] - x[1] + 1.0);
    let union = area(a) + area(b) - inter;
    if union > 0.0 {
        inter / union
    } else {
        0.0
    }
}

/// The average precision of a curve; `recall` and `precision` in order of falling score.
pub fn average_precision(recall: &[f32], precision: &[f32], mode: ApMode) -> f32 {
    match mode {
        ApMode::ElevenPoints => {
            let mut ap = 0.0;
            for k in 0..=10 {
                let threshold = k as f32 / 10.0;
                let best = recall
                    .iter()
                    .zip(precision)
                    .filter(|(r, _)| **r >= threshold)
                    .map(|(_, p)| *p)
                    .fold(0.0f32, f32::max);
                ap += best;
            }
            ap / 11.0
        }
        ApMode::Area => {
            let mut mrec = vec![0.0f32];
            mrec.extend_from_slice(recall);
            mrec.push(1.0);
            let mut mpre = vec![0.0f32];
            mpre.extend_from_slice(precision);
            mpre.push(0.0);
            for i in (0..mpre.len() - 1).rev() {
                mpre[i] = mpre[i].max(mpre[i + 1]);
            }
            (1..mrec.len())
                .filter(|&i| mrec[i] != mrec[i - 1])
                .map(|i| (mrec[i] - mrec[i - 1]) * mpre[i])
                .sum()
        }
    }
}

/// VOC mAP of `detections` on `images` at `iou_thr` (VOC: 0.5). Detections of images not in
/// `images` are an error naming them.
pub fn voc_map(
    images: &[VocImage],
    detections: &[DetectionRecord],
    iou_thr: f32,
    mode: ApMode,
) -> Result<MapResult> {
    let index: std::collections::HashMap<&str, usize> = images
        .iter()
        .enumerate()
        .map(|(i, im)| (im.id.as_str(), i))
        .collect();
    let mut per_class: Vec<Vec<(usize, f32, [f32; 4])>> = vec![Vec::new(); VOC_CLASSES.len()];
    for (k, d) in detections.iter().enumerate() {
        let image = *index.get(d.image.as_str()).ok_or_else(|| {
            Error::Data(format!(
                "detection {k}: image `{}` is not in the split",
                d.image
            ))
        })?;
        let label = class_index(&d.class)
            .ok_or_else(|| Error::Data(format!("detection {k}: unknown class `{}`", d.class)))?;
        check_box(k, d, &images[image])?;
        per_class[label].push((image, d.score, d.bbox));
    }
    let mut classes = Vec::with_capacity(VOC_CLASSES.len());
    for (label, dets) in per_class.iter_mut().enumerate() {
        let num_gts = images
            .iter()
            .flat_map(|im| &im.objects)
            .filter(|o| o.label == label && !o.difficult)
            .count();
        // Best first; equal scores keep file order.
        dets.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut covered: Vec<Vec<bool>> = images
            .iter()
            .map(|im| vec![false; im.objects.len()])
            .collect();
        let (mut tp, mut fp) = (
            Vec::with_capacity(dets.len()),
            Vec::with_capacity(dets.len()),
        );
        for &(image, _, bbox) in dets.iter() {
            let objects = &images[image].objects;
            let (mut best, mut best_j) = (f32::NEG_INFINITY, None);
            for (j, o) in objects.iter().enumerate() {
                if o.label != label {
                    continue;
                }
                let overlap = legacy_iou(&bbox, &o.bbox);
                if overlap > best {
                    (best, best_j) = (overlap, Some(j));
                }
            }
            let (mut is_tp, mut is_fp) = (false, false);
            match best_j {
                Some(j) if best >= iou_thr => {
                    if objects[j].difficult {
                        // Neither found nor missed.
                    } else if !covered[image][j] {
                        covered[image][j] = true;
                        is_tp = true;
                    } else {
                        is_fp = true;
                    }
                }
                _ => is_fp = true,
            }
            tp.push(is_tp as u32);
            fp.push(is_fp as u32);
        }
        let (mut recall, mut precision) = (Vec::new(), Vec::new());
        let (mut ctp, mut cfp) = (0u32, 0u32);
        for (t, f) in tp.iter().zip(&fp) {
            ctp += t;
            cfp += f;
            recall.push(ctp as f32 / (num_gts as f32).max(f32::EPSILON));
            precision.push(ctp as f32 / ((ctp + cfp) as f32).max(f32::EPSILON));
        }
        let ap = if num_gts == 0 {
            0.0
        } else {
            average_precision(&recall, &precision, mode)
        };
        classes.push(ClassAp {
            class: VOC_CLASSES[label],
            num_gts,
            num_dets: dets.len(),
            recall: if num_gts == 0 {
                0.0
            } else {
                recall.last().copied().unwrap_or(0.0)
            },
            ap,
        });
    }
    let scored: Vec<f32> = classes
        .iter()
        .filter(|c| c.num_gts > 0)
        .map(|c| c.ap)
        .collect();
    let map = if scored.is_empty() {
        0.0
    } else {
        scored.iter().sum::<f32>() / scored.len() as f32
    };
    Ok(MapResult { classes, map })
}
