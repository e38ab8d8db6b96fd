//! MMDetection's `DeltaXYWHBBoxCoder` (means 0, stds 1): a box relative to an anchor as
//! `(dx, dy, dw, dh)`, centres in anchor widths and sizes as logarithms.

use super::boxes::BBox;

/// The largest `|dw|`, `|dh|` a decode accepts: `log(1000 / 16)`.
pub fn wh_ratio_clip() -> f32 {
    (1000.0f32 / 16.0).ln()
}

fn centre_size(b: &BBox) -> [f32; 4] {
    let (w, h) = (b[2] - b[0], b[3] - b[1]);
    [b[0] + 0.5 * w, b[1] + 0.5 * h, w, h]
}

/// The deltas that take `anchor` to `target`.
pub fn encode(anchor: &BBox, target: &BBox) -> [f32; 4] {
    let [px, py, pw, ph] = centre_size(anchor);
    let [gx, gy, gw, gh] = centre_size(target);
    [
        (gx - px) / pw,
        (gy - py) / ph,
        (gw / pw).ln(),
        (gh / ph).ln(),
    ]
}

/// The box `deltas` make of `anchor`, the size change clamped at `log(1000 / 16)` and the
/// box clipped to `max_shape` (`[height, width]`) when given.
pub fn decode(anchor: &BBox, deltas: &[f32; 4], max_shape: Option<[f32; 2]>) -> BBox {
    let [px, py, pw, ph] = centre_size(anchor);
    let clip = wh_ratio_clip();
    let (dw, dh) = (deltas[2].clamp(-clip, clip), deltas[3].clamp(-clip, clip));
    let (gw, gh) = (pw * dw.exp(), ph * dh.exp());
    let (gx, gy) = (px + pw * deltas[0], py + ph * deltas[1]);
    let mut b = [gx - 0.5 * gw, gy - 0.5 * gh, gx + 0.5 * gw, gy + 0.5 * gh];
    if let Some([h, w]) = max_shape {
        b[0] = b[0].clamp(0.0, w);
        b[2] = b[2].clamp(0.0, w);
        b[1] = b[1].clamp(0.0, h);
        b[3] = b[3].clamp(0.0, h);
    }
    b
}
