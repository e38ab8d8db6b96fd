//! Boxes as `[x1, y1, x2, y2]` in pixels, and their overlaps (MMDetection's `bbox_overlaps`
//! without the legacy `+ 1`: a box from 0 to 10 is 10 wide).

/// A box `[x1, y1, x2, y2]`.
pub type BBox = [f32; 4];

/// Area of `b` (0 for an empty or inverted box).
pub fn area(b: &BBox) -> f32 {
    (b[2] - b[0]).max(0.0) * (b[3] - b[1]).max(0.0)
}

/// Intersection over union of two boxes (0 when both are empty).
pub fn iou(a: &BBox, b: &BBox) -> f32 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = w * h;
    let union = area(a) + area(b) - inter;
    if union > 0.0 {
        inter / union
    } else {
        0.0
    }
}

/// The IoU matrix `[a.len(), b.len()]`, row-major.
pub fn iou_matrix(a: &[BBox], b: &[BBox]) -> Vec<f32> {
    let mut out = Vec::with_capacity(a.len() * b.len());
    for x in a {
        for y in b {
            out.push(iou(x, y));
        }
    }
    out
}
