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
    current_bytes, is_counting, peak_bytes, reset_peak, take_window_peak, CountingAllocator,
};
pub use meter::{meter_for, AllocatorMeter, Meter, PoolReadings};
pub use tags::{live_by_tag, peak_by_tag, scope, scope_path, snapshot_peaks, TagBytes};
pub use timeline::{Sample, Timeline};

pub mod phase;
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
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

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

/// Whether a panic message is a device allocator's out-of-memory report (CubeCL:
/// "can't allocate buffer of size", "out-of-memory error"; CUDA's `CUDA_ERROR_OUT_OF_MEMORY`).
pub fn is_out_of_memory_panic(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("can't allocate buffer of size")
        || lower.contains("out-of-memory")
        || lower.contains("out of memory")
        || lower.contains("cuda_error_out_of_memory")
}

/// Panics on other threads since [`other_thread_panics`] last took them: a CubeCL runtime's
/// server thread (wgpu's) panics where its allocator cannot find room, and the thread that waits
/// for its result only learns that "an error happened during execution".
static OTHER_PANICS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Keeps the message of every panic on a thread other than this one (the runner's), the panic
/// hook that was there still called. Installed once per process.
pub(crate) fn watch_other_threads() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let runner = std::thread::current().id();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().id() != runner {
                let text = crate::panic_text(info.payload())
                    .map(str::to_string)
                    .unwrap_or_else(|| info.to_string());
                let mut panics = OTHER_PANICS.lock().unwrap_or_else(|e| e.into_inner());
                if panics.len() < 64 {
                    panics.push(text);
                }
            }
            previous(info)
        }));
    });
}

/// The panics [`watch_other_threads`] kept since the last call, emptied.
pub(crate) fn other_thread_panics() -> Vec<String> {
    std::mem::take(&mut *OTHER_PANICS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The size an out-of-memory panic names (`can't allocate buffer of size: N`), if any.
pub fn out_of_memory_size(message: &str) -> Option<u64> {
    let rest = message.split("buffer of size").nth(1)?;
    let digits: String = rest
        .trim_start_matches([':', ' '])
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
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

/// The memory pools of any CubeCL runtime (CUDA, wgpu, ROCm).
#[cfg(feature = "cubecl")]
pub mod cube {
    use cubecl::stream_id::StreamId;
    use cubecl::Runtime;

    /// Bytes in use and bytes reserved by the pools of the calling thread's stream on `device`
    /// (CubeCL keeps pools per stream: a thread's own, which memsave's recompute helpers
    /// share) and, where activation offload has used it, of that stream's copy stream
    /// ([`crate::checkpoint::copy_stream`], whose pool holds the inputs prefetched back); `None`
    /// if the runtime could not say.
    pub fn pool_usage<R: Runtime>(device: &R::Device) -> Option<(u64, u64)> {
        let usage = R::client(device).memory_usage().ok()?;
        let (mut in_use, mut reserved) = (usage.bytes_in_use, usage.bytes_reserved);
        if let Some(copies) = crate::checkpoint::copy_stream_in_use(StreamId::current()) {
            // Where only that reading fails, the training stream's stands alone.
            if let Some(usage) = copies.executes(|| R::client(device).memory_usage().ok()) {
                in_use += usage.bytes_in_use;
                reserved += usage.bytes_reserved;
            }
        }
        Some((in_use, reserved))
    }

    /// The meter of `device`'s pools, those of the stream of the thread that makes it and of its
    /// copy stream ([`pool_usage`], read on that stream from any thread); see [`crate::memory::Meter`] for what each reading means.
    pub fn pool_meter<R: Runtime>(
        device: R::Device,
    ) -> crate::memory::PoolReadings<impl Fn() -> Option<(u64, u64)> + Send + Sync + 'static> {
        let stream = StreamId::current();
        crate::memory::PoolReadings::new(move || stream.executes(|| pool_usage::<R>(&device)))
    }

    /// Whether the runtime and `device` can be opened: `Err` with the runtime's words where
    /// not (CubeCL panics when the driver library or an adapter is missing; that panic is
    /// caught here).
    pub fn probe<R: Runtime>(device: &R::Device) -> Result<(), String> {
        // The runtime's own words are its server thread's panic ("No possible adapter
        // available"); the calling thread only learns that the answer never came.
        static FIRST: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
        let first = || {
            FIRST
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        };
        *first() = None;
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Some(text) = crate::panic_text(info.payload()) {
                let mut first = FIRST
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                first.get_or_insert_with(|| text.to_string());
            }
        }));
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            R::client(device).memory_usage().map(|_| ())
        }));
        std::panic::set_hook(report);
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(format!("{error:?}")),
            Err(payload) => Err(first()
                .take()
                .or_else(|| crate::panic_text(payload.as_ref()).map(str::to_string))
                .unwrap_or_else(|| "the GPU runtime could not start".to_string())),
        }
    }
}

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
