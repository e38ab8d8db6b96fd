//! Peak-memory measurement on the CPU: a counting global allocator, the analogue of
//! `torch.cuda.max_memory_allocated`.
//!
//! Install it in your binary (a library cannot choose the allocator for you):
//!
//! ```
//! #[global_allocator]
//! static ALLOCATOR: memsave_core::memory::CountingAllocator =
//!     memsave_core::memory::CountingAllocator;
//!
//! fn main() {
//!     use memsave_core::memory;
//!     assert!(memory::is_counting());
//!     let baseline = memory::reset_peak();
//!     let buffer = vec![1u8; 1 << 20];
//!     drop(buffer);
//!     assert!(memory::peak_bytes() - baseline >= 1 << 20);
//!     // What the training log reports for a CPU run.
//!     let cpu: burn::tensor::Device<burn::backend::Flex> = Default::default();
//!     assert_eq!(memory::device_peak_bytes(&cpu), Some(memory::peak_bytes() as u64));
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
pub use meter::{meter_for, peer_meter_for, AllocatorMeter, Meter, PoolReadings};
pub use tags::{live_by_tag, peak_by_tag, scope, scope_path, snapshot_peaks, TagBytes};
pub use timeline::{Sample, Timeline};

pub mod oom;
pub mod phase;
pub use oom::{is_out_of_memory_panic, out_of_memory_size};
pub(crate) use oom::{other_thread_panics, watch_other_threads};
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
pub use memsave_common::human_bytes as human;

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

/// [`Meter::peak`] of `device`'s meter ([`meter_for`]): what a log line reports as memory.
/// `None` where the device's memory cannot be read.
pub fn device_peak_bytes<D: 'static>(device: &D) -> Option<u64> {
    meter_for(device).map(|meter| meter.peak())
}

/// Where a run on `device` allocates, in words, and the bytes available there when known: the
/// host memory for a CPU device; on CUDA, `the GPU` (its free memory is not read: its
/// allocator's failure is caught instead).
pub fn device_available_bytes<D: 'static>(device: &D) -> (String, Option<u64>) {
    #[cfg(feature = "cuda")]
    if (device as &dyn std::any::Any).is::<cubecl::cuda::CudaDevice>() {
        return ("the GPU".to_string(), None);
    }
    #[cfg(feature = "wgpu")]
    if (device as &dyn std::any::Any).is::<cubecl::wgpu::WgpuDevice>() {
        return ("the GPU".to_string(), None);
    }
    let _ = device;
    ("this machine".to_string(), available_bytes())
}

/// The memory pools of any CubeCL runtime (CUDA, wgpu, ROCm), and the streams activation
/// offload's copies run on.
#[cfg(feature = "cubecl")]
pub mod cube;

/// One runtime's module of [`cube`]'s readings, by its device type.
#[cfg(feature = "cubecl")]
macro_rules! runtime_pools {
    ($(#[$doc:meta])* $module:ident, $device:ident, $runtime:ident, $path:ident) => {
        $(#[$doc])*
        pub mod $module {
            use cubecl::$path::{$device, $runtime};

            /// Bytes in use and bytes reserved by the pools on `device`
            /// ([`super::cube::pool_usage`]).
            pub fn pool_usage(device: &$device) -> Option<(u64, u64)> {
                super::cube::pool_usage::<$runtime>(device)
            }

            /// The meter of `device`'s pools ([`super::cube::pool_meter`]).
            pub fn pool_meter(
                device: $device,
            ) -> crate::memory::PoolReadings<impl Fn() -> Option<(u64, u64)> + Send + Sync + 'static>
            {
                super::cube::pool_meter::<$runtime>(device)
            }

            /// Whether the runtime can open `device` ([`super::cube::probe`]).
            pub fn probe(device: &$device) -> Result<(), String> {
                super::cube::probe::<$runtime>(device)
            }
        }
    };
}

#[cfg(feature = "cuda")]
runtime_pools!(
    /// CUDA: the memory pools of CubeCL, Burn's CUDA runtime.
    cuda, CudaDevice, CudaRuntime, cuda
);
#[cfg(feature = "wgpu")]
runtime_pools!(
    /// wgpu (Vulkan, Metal, DX12): the memory pools of CubeCL, Burn's wgpu runtime.
    wgpu, WgpuDevice, WgpuRuntime, wgpu
);
