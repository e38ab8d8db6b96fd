//! Peak-memory measurement on the CPU: a counting global allocator, the analogue of
//! `torch.cuda.max_memory_allocated`, its tags (phases and layers), its timeline, and the one
//! [`Meter`] trait that every device's memory is read through. Burn-free: each runtime adds its
//! devices' meters (`memory::meter_for`) and re-exports these where they stood.
//!
//! Install the allocator in your binary (a library cannot choose the allocator for you):
//!
//! ```
//! #[global_allocator]
//! static ALLOCATOR: memsave_common::memory::CountingAllocator =
//!     memsave_common::memory::CountingAllocator;
//!
//! fn main() {
//!     use memsave_common::memory;
//!     assert!(memory::is_counting());
//!     let baseline = memory::reset_peak();
//!     let buffer = vec![1u8; 1 << 20];
//!     drop(buffer);
//!     assert!(memory::peak_bytes() - baseline >= 1 << 20);
//! }
//! ```
//!
//! Then [`reset_peak`] after the model and optimizer are built, run, and read [`peak_bytes`]
//! minus the baseline [`current_bytes`] taken at the reset.

mod allocator;
mod meter;
mod tags;
mod timeline;

pub use allocator::{
    current_bytes, fresh_slot, is_counting, peak_bytes, reset_peak, set_thread_slot,
    take_window_peak, thread_slot, CountingAllocator, SlotMeter, SLOTS,
};
pub use meter::{for_peer, AllocatorMeter, Meter, PoolReadings};
pub use tags::{live_by_tag, peak_by_tag, scope, scope_path, snapshot_peaks, TagBytes};
pub use timeline::{Sample, Timeline};

pub mod oom;
pub mod phase;
pub use oom::{
    is_out_of_memory_panic, other_thread_panics, out_of_memory_size, watch_other_threads,
};
pub use phase::{in_phase, on_phase_end};

use allocator::{CURRENT, PEAK};
use std::sync::atomic::Ordering;

/// Runs `f` without letting it raise the peak: for work outside what is measured, such as
/// writing a checkpoint between training steps. Afterwards the peak is what it was before, or
/// the live bytes now if they are more.
pub fn without_peak<T>(f: impl FnOnce() -> T) -> T {
    let before = PEAK.load(Ordering::Relaxed);
    let out = f();
    PEAK.store(
        before.max(CURRENT.load(Ordering::Relaxed)),
        Ordering::Relaxed,
    );
    out
}

/// `bytes` as MiB, for reports.
pub fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `bytes` in the largest binary unit that keeps the number at or above 1 (`894.1 GiB`).
pub use crate::human_bytes as human;

/// Bytes of host memory available to this process now (Linux: `MemAvailable` of
/// `/proc/meminfo`, capped by a cgroup limit when one is set), or `None` elsewhere.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("MemAvailable:")?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    })?;
    let limit = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|path| {
        std::fs::read_to_string(path)
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    });
    Some(match limit {
        Some(limit) => available.min(limit.saturating_sub(current_bytes() as u64)),
        None => available,
    })
}
