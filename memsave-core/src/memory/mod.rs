//! Peak-memory measurement: memsave-common's counting allocator, tags, timeline and meters
//! ([`memsave_common::memory`], re-exported here), and the meters of Burn 0.21's devices.
//!
//! Install the allocator in your binary (a library cannot choose the allocator for you):
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

mod meter;

pub use memsave_common::memory::*;
pub use meter::{meter_for, peer_meter_for};

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
