//! The counting allocator's peak, and work kept out of it.

use memsave::memory::{self, CountingAllocator};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const MIB_64: usize = 64 << 20;

/// One test only: the counters are process-wide, and parallel tests would move them.
#[test]
fn the_peak_counts_allocations_except_inside_without_peak() {
    assert!(memory::is_counting());

    let baseline = memory::reset_peak();
    let buffer = std::hint::black_box(vec![1u8; MIB_64]);
    drop(buffer);
    assert!(memory::peak_bytes() >= baseline + MIB_64);

    let baseline = memory::reset_peak();
    let kept = memory::without_peak(|| {
        let temporary = std::hint::black_box(vec![2u8; MIB_64]);
        drop(temporary);
        std::hint::black_box(vec![3u8; 1 << 20])
    });
    // The temporary 64 MiB are forgotten; what is still live afterwards counts.
    let peak = memory::peak_bytes();
    assert!(peak < baseline + MIB_64, "peak {peak}, baseline {baseline}");
    assert!(
        peak >= baseline + (1 << 20),
        "peak {peak}, baseline {baseline}"
    );
    drop(kept);
}
