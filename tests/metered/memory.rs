//! The counting allocator's peak, and work kept out of it.

use memsave::memory;

const MIB_64: usize = 64 << 20;

/// The counters are process-wide: the test holds the binary's turn.
#[test]
fn the_peak_counts_allocations_except_inside_without_peak() {
    let _turn = crate::TURN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    assert!(memory::is_counting());

    // Read around the allocation alone, within a MiB: the thread of the test before this one
    // may still be freeing its thread-locals while the 64 MiB are written (this binary's tests
    // take turns, their threads' exits do not; half a MiB was seen).
    memory::reset_peak();
    let before = memory::current_bytes();
    let buffer = std::hint::black_box(vec![1u8; MIB_64]);
    let with_buffer = memory::current_bytes();
    drop(buffer);
    assert!(
        with_buffer + (1 << 20) >= before + MIB_64,
        "{before} then {with_buffer}"
    );
    let peak = memory::peak_bytes();
    assert!(
        peak >= with_buffer,
        "peak {peak}, {with_buffer} live with the buffer"
    );

    let baseline = memory::reset_peak();
    let kept = memory::without_peak(|| {
        let temporary = std::hint::black_box(vec![2u8; MIB_64]);
        drop(temporary);
        std::hint::black_box(vec![3u8; 1 << 20])
    });
    // The temporary 64 MiB are forgotten; what is still live afterwards counts.
    let with_kept = memory::current_bytes();
    let peak = memory::peak_bytes();
    assert!(peak < baseline + MIB_64, "peak {peak}, baseline {baseline}");
    assert!(
        peak >= with_kept,
        "peak {peak}, {with_kept} live with the kept MiB"
    );
    drop(kept);
}
