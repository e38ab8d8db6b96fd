//! Counter-based uniform draws: any stream, and any part of it, is reproducible on its own (a
//! resumed run, a peer stepping its part of the parameters, a parameter rounded a slice at a
//! time). The stochastic rounding of 16-bit weights draws from them.

/// The uniform draws in `[0, 1)` of values `first..first + n` of the stream `key`: SplitMix64
/// of the key and each value's index, 24 bits each.
pub fn uniforms(key: u64, first: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let bits = splitmix64(key ^ splitmix64((first + i) as u64));
            (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
        })
        .collect()
}

/// SplitMix64's output function (Steele, Lea and Flood 2014).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

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
