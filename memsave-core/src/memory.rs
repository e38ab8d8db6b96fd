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

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes and their peak.
pub struct CountingAllocator;

impl CountingAllocator {
    fn grew(size: usize) {
        let now = CURRENT.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }

    fn shrank(size: usize) {
        CURRENT.fetch_sub(size, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are updated around it.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            Self::grew(layout.size());
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc_zeroed(layout) };
        if !pointer.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            Self::grew(layout.size());
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        Self::shrank(layout.size());
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(pointer, layout, new_size) };
        if !new.is_null() {
            if new_size >= layout.size() {
                Self::grew(new_size - layout.size());
            } else {
                Self::shrank(layout.size() - new_size);
            }
        }
        new
    }
}

/// Whether a [`CountingAllocator`] is this program's global allocator.
pub fn is_counting() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Live heap bytes now.
pub fn current_bytes() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// The most live heap bytes since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak at the current live bytes, and returns them (the baseline).
pub fn reset_peak() -> usize {
    let now = CURRENT.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

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

/// What a log line reports as memory for a run on `device`: on the CPU, the live heap bytes
/// peak since the last [`reset_peak`] (when a [`CountingAllocator`] is installed); on CUDA
/// (feature `cuda`), the bytes CubeCL's pools hold reserved, their high-water mark. `None` where
/// neither can be read.
pub fn device_peak_bytes<D: 'static>(device: &D) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Some(device) = (device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>()
    {
        return cuda::pool_usage(device).map(|(_, reserved)| reserved);
    }
    let _ = device;
    is_counting().then(|| peak_bytes() as u64)
}

/// CUDA: the memory pools of CubeCL, Burn's CUDA runtime.
#[cfg(feature = "cuda")]
pub mod cuda {
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::Runtime;

    /// Bytes in use and bytes reserved by the pools on `device`, or `None` if the runtime
    /// could not say. Reserved bytes are the pools' high-water mark until
    /// `Backend::memory_cleanup` returns unused pages: the CUDA analogue of a peak.
    pub fn pool_usage(device: &CudaDevice) -> Option<(u64, u64)> {
        let usage = CudaRuntime::client(device).memory_usage().ok()?;
        Some((usage.bytes_in_use, usage.bytes_reserved))
    }
}
