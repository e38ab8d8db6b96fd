//! Peak-memory measurement on Burn 0.22: memsave-common's counting allocator, tags, timeline
//! and meters (re-exported here, the same for memsave on Burn 0.21), and the meter of a Burn
//! 0.22 [`Device`].
//!
//! Install the allocator in your binary (a library cannot choose the allocator for you), then
//! read a device's memory through its meter:
//!
//! ```
//! #[global_allocator]
//! static ALLOCATOR: memsave_next::memory::CountingAllocator =
//!     memsave_next::memory::CountingAllocator;
//!
//! fn main() {
//!     use burn::tensor::{Device, Tensor};
//!     use memsave_next::memory;
//!     let device = Device::default();
//!     let meter = memory::meter_for(&device).expect("the allocator is installed");
//!     let baseline = meter.reset_peak();
//!     let x = Tensor::<2>::ones([256, 256], &device);
//!     drop(x);
//!     assert!(meter.peak() - baseline >= 256 * 256 * 4);
//! }
//! ```

use burn::backend::DispatchDevice;
use burn::tensor::Device;

pub use memsave_common::memory::*;

/// The meter of `device` ([`Meter`]): on the CPU (Flex), the counting allocator when it is
/// installed; `None` where the device's memory cannot be read (the counting allocator not
/// installed; a CubeCL device until its pools' meter comes to Burn 0.22 with a later slice of
/// the port; another backend). An autodiff device is metered as the device it runs on.
pub fn meter_for(device: &Device) -> Option<Box<dyn Meter>> {
    let device = device.clone().without_autodiff();
    match device.as_dispatch() {
        DispatchDevice::Flex(_) => {
            is_counting().then(|| Box::new(AllocatorMeter) as Box<dyn Meter>)
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// [`meter_for`] as the calling thread's data-parallel peer sees it (its slot's bytes on the
/// CPU, where the peers of one process share the heap; see [`for_peer`]).
pub fn peer_meter_for(device: &Device) -> Option<Box<dyn Meter>> {
    meter_for(device).map(for_peer)
}

/// [`Meter::peak`] of `device`'s meter: what a log line reports as memory. `None` where the
/// device's memory cannot be read.
pub fn device_peak_bytes(device: &Device) -> Option<u64> {
    meter_for(device).map(|meter| meter.peak())
}
