//! Rounding fp32 values to a 16-bit float type: to nearest (the cast), stochastically (to one of
//! the two neighbours, with the probability that makes the expected result the fp32 value), or
//! with Kahan's compensation (the rounding error kept and added to the next update).
//!
//! Written with tensor operations only, so that every backend runs it: the two neighbours of a
//! value are found with casts (Burn 0.21 has no bit casts), as follows. `r` is the value rounded
//! to nearest and `d` what that lost. The other neighbour lies one spacing away from `r` on
//! `d`'s side; moving `r` by 0.7 of the spacing at `r`'s own binade (`|r| * 0.7 * 2^-p`, `p` the
//! mantissa bits) and rounding to nearest lands on it in every case: inside a binade the move is
//! 0.7 to 1.4 spacings (nearest: one spacing), and down from a power of two, where the spacing
//! below is half as large, it is 1.4 of those (nearest: one of them). Below the smallest normal
//! the spacing is the smallest subnormal, which the move is never less than.

use super::WeightDtypeExt;
use burn::prelude::Backend;
use burn::tensor::{Bool, DType, Tensor};

use super::WeightDtype;

/// The two constants of [`WeightDtype`]'s type: 0.7 times 2 to the minus the mantissa bits,
/// and 0.7 times its smallest subnormal.
fn moves(dtype: WeightDtype) -> (f32, f32) {
    match dtype {
        // bf16: 7 mantissa bits, smallest subnormal 2^-133.
        WeightDtype::Bf16 => (0.7 / 128.0, 0.7 * (2f32).powi(-133)),
        // f16: 10 mantissa bits, smallest subnormal 2^-24.
        WeightDtype::F16 | WeightDtype::F32 => (0.7 / 1024.0, 0.7 * (2f32).powi(-24)),
    }
}

/// `x` (fp32) rounded to nearest in `dtype`, back in fp32.
pub(super) fn nearest<K: Backend, const D: usize>(x: Tensor<K, D>, dtype: DType) -> Tensor<K, D> {
    x.cast(dtype).cast(DType::F32)
}

/// `x` (fp32) rounded stochastically to `dtype` with the uniform draws `u` (in `[0, 1)`, one per
/// value): to the neighbour farther away with probability `distance to the nearer / spacing`,
/// so that the expected result is `x` itself. Returned in fp32 (its values are `dtype`'s).
pub(super) fn stochastic<K: Backend, const D: usize>(
    x: Tensor<K, D>,
    u: Tensor<K, D>,
    dtype: WeightDtype,
) -> Tensor<K, D> {
    let half = dtype.dtype();
    let (fraction, smallest) = moves(dtype);
    let r = nearest(x.clone(), half);
    let d = x.sub(r.clone());
    let step = r
        .clone()
        .abs()
        .mul_scalar(fraction)
        .clamp_min(smallest)
        .mul(d.clone().sign());
    let other = nearest(r.clone().add(step), half);
    let spacing = other.clone().sub(r.clone()).abs();
    // Where `d` is 0 the other neighbour is `r` itself and the probability 0.
    let p = d.abs().div(spacing.clamp_min(f32::from_bits(1)));
    let farther: Tensor<K, D, Bool> = u.lower(p);
    r.mask_where(farther, other)
}

/// Kahan-compensated update of a 16-bit weight: `old` (fp32, the stored value), `new` (fp32, the
/// optimizer's result) and the compensation `carry` (fp32) so far. Returns the new stored value
/// (rounded to nearest, in fp32) and the new compensation: what the rounding lost of the update
/// and the carry, added to the next update (Kahan summation as "Revisiting BFloat16 Training",
/// Zamirai et al. 2020, applies it to weight updates).
pub(super) fn kahan<K: Backend, const D: usize>(
    old: Tensor<K, D>,
    new: Tensor<K, D>,
    carry: Tensor<K, D>,
    dtype: DType,
) -> (Tensor<K, D>, Tensor<K, D>) {
    let update = new.sub(old.clone()).add(carry);
    let stored = nearest(old.clone().add(update.clone()), dtype);
    let carry = update.sub(stored.clone().sub(old));
    (stored, carry)
}

/// The uniform draws in `[0, 1)` of values `first..first + n` of the stream `key`: SplitMix64
/// of the key and each value's index (counter-based, so that any stream, and any part of it, is
/// reproducible on its own: a resumed run, a peer stepping its part of the parameters, a
/// parameter rounded a slice at a time), 24 bits each.
pub(super) fn uniforms(key: u64, first: usize, n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(chunk, values)| {
            let start = (first + (chunk << 16)) as u64;
            for (i, value) in values.iter_mut().enumerate() {
                let bits = splitmix64(key ^ splitmix64(start + i as u64));
                *value = (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
            }
        });
    out
}

/// SplitMix64's output function (Steele, Lea and Flood 2014).
pub(super) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;
    use burn_flex::Flex;

    type K = Flex;

    fn tensor(values: &[f32]) -> Tensor<K, 1> {
        Tensor::from_data(
            TensorData::new(values.to_vec(), [values.len()]),
            &Default::default(),
        )
    }

    fn values(t: Tensor<K, 1>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    /// The two bf16 neighbours of `x`, from its bits (truncation and the next value up in
    /// magnitude): what the tensor arithmetic must agree with.
    fn neighbours(x: f32, dtype: WeightDtype) -> (f32, f32) {
        let to = |v: f32| match dtype {
            WeightDtype::Bf16 => half::bf16::from_f32(v).to_f32(),
            _ => half::f16::from_f32(v).to_f32(),
        };
        let r = to(x);
        if r == x {
            return (r, r);
        }
        // Walk from `r` one representable value towards `x`.
        let other = match dtype {
            WeightDtype::Bf16 => {
                let b = half::bf16::from_f32(r).to_bits();
                let away = (x.abs() > r.abs()) || r == 0.0;
                let bits = if r == 0.0 {
                    1 | if x < 0.0 { 0x8000 } else { 0 }
                } else if away {
                    b + 1
                } else {
                    b - 1
                };
                half::bf16::from_bits(bits).to_f32()
            }
            _ => {
                let b = half::f16::from_f32(r).to_bits();
                let away = (x.abs() > r.abs()) || r == 0.0;
                let bits = if r == 0.0 {
                    1 | if x < 0.0 { 0x8000 } else { 0 }
                } else if away {
                    b + 1
                } else {
                    b - 1
                };
                half::f16::from_bits(bits).to_f32()
            }
        };
        (r, other)
    }

    /// Every value, draw by draw: the result is one of its two neighbours, the farther one
    /// exactly when the draw is below the distance to the nearer over the spacing. Covers the
    /// cases the casts must get right: powers of two (up and down), the last value of a binade,
    /// negative values, subnormals and values below the smallest one.
    #[test]
    fn stochastic_rounding_picks_the_neighbours_with_the_right_odds() {
        for dtype in [WeightDtype::Bf16, WeightDtype::F16] {
            let mut xs = vec![
                1.0 + 1e-3,
                1.0 - 1e-3,
                -1.0 - 1e-3,
                -(1.0 - 1e-3),
                2.0 - 1e-4,
                0.3,
                -0.7,
                1e-3,
                123.456,
                0.0,
                1.5,
            ];
            let tiny = match dtype {
                WeightDtype::Bf16 => (2f32).powi(-130) * 1.3,
                _ => (2f32).powi(-20) * 1.3,
            };
            xs.extend([tiny, -tiny, tiny / 200.0]);
            for (k, &x) in xs.iter().enumerate() {
                let (r, other) = neighbours(x, dtype);
                let p = if r == other {
                    0.0
                } else {
                    ((x - r).abs() / (other - r).abs()) as f64
                };
                for u in [0.0f32, 0.25, 0.5, 0.75, 0.999] {
                    let got = values(stochastic(tensor(&[x]), tensor(&[u]), dtype))[0];
                    let want = if (u as f64) < p { other } else { r };
                    assert_eq!(got, want, "{dtype:?} x={x} (case {k}) u={u} p={p}");
                }
            }
        }
    }

    /// Over many draws, the mean of the rounded values is the fp32 value (unbiased), where
    /// rounding to nearest is off by the whole rounding error.
    #[test]
    fn stochastic_rounding_is_unbiased() {
        let x = 1.0f32 + 3.0 / 1024.0; // between bf16's 1.0 and 1.0078125
        let n = 20_000;
        let xs = tensor(&vec![x; n]);
        let u = tensor(&uniforms(7, 0, n));
        let mean = values(stochastic(xs, u, WeightDtype::Bf16))
            .iter()
            .map(|&v| v as f64)
            .sum::<f64>()
            / n as f64;
        let spacing = 1.0 / 128.0;
        assert!(
            (mean - x as f64).abs() < spacing * 0.02,
            "mean {mean} for {x}"
        );
        assert_eq!(half::bf16::from_f32(x).to_f32(), 1.0);
    }

    /// Kahan's carry keeps updates smaller than half a spacing: a hundred of them move the
    /// weight where rounding to nearest leaves it where it was.
    #[test]
    fn kahan_keeps_updates_below_the_spacing() {
        let mut w = tensor(&[1.0]);
        let mut plain = tensor(&[1.0]);
        let mut carry = tensor(&[0.0]);
        for _ in 0..100 {
            let new = w.clone().add_scalar(1e-4);
            let (stored, c) = kahan(w, new, carry, DType::BF16);
            w = stored;
            carry = nearest(c, DType::BF16);
            plain = nearest(plain.clone().add_scalar(1e-4), DType::BF16);
        }
        assert_eq!(values(plain)[0], 1.0);
        let moved = values(w)[0] + values(carry)[0];
        assert!((moved - 1.01).abs() < 1e-3, "{moved}");
    }

    #[test]
    fn draws_are_uniform_and_reproducible() {
        let a = uniforms(42, 0, 100_000);
        assert_eq!(a, uniforms(42, 0, 100_000));
        // Any part of the stream on its own.
        assert_eq!(a[70_000..70_100], uniforms(42, 70_000, 100)[..]);
        assert_ne!(a[..100], uniforms(43, 0, 100)[..]);
        let mean = a.iter().map(|&v| v as f64).sum::<f64>() / a.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        assert!(a.iter().all(|&v| (0.0..1.0).contains(&v)));
    }
}
