//! The meter of a device on Burn 0.21: its CubeCL pools (features `cuda`, `wgpu`) or the counting
//! allocator. The meters themselves, and what each reading means where, are memsave-common's
//! ([`memsave_common::memory::Meter`]).

use super::{AllocatorMeter, Meter};

/// The meter of `device`: its pools on a CubeCL device (features `cuda`, `wgpu`), the counting
/// allocator on the CPU when it is installed; `None` where neither can be read.
pub fn meter_for<D: 'static>(device: &D) -> Option<Box<dyn Meter>> {
    let any = device as &dyn std::any::Any;
    #[cfg(feature = "cuda")]
    if let Some(device) = any.downcast_ref::<cubecl::cuda::CudaDevice>() {
        return Some(Box::new(super::cuda::pool_meter(device.clone())));
    }
    #[cfg(feature = "wgpu")]
    if let Some(device) = any.downcast_ref::<cubecl::wgpu::WgpuDevice>() {
        return Some(Box::new(super::wgpu::pool_meter(device.clone())));
    }
    let _ = any;
    super::is_counting().then(|| Box::new(AllocatorMeter) as Box<dyn Meter>)
}

/// [`meter_for`] as the calling thread's data-parallel peer sees it: on the CPU, where the
/// peers of one process share its heap, the bytes charged to the peer's slot
/// ([`super::SlotMeter`]: its training thread's and its helpers' blocks); elsewhere, and on a
/// thread of no peer, the device's meter.
pub fn peer_meter_for<D: 'static>(device: &D) -> Option<Box<dyn Meter>> {
    meter_for(device).map(memsave_common::memory::for_peer)
}
