//! The link between a device and host memory, measured: what the planner prices CPU staging's
//! copies at.

use burn::prelude::Backend;
use burn::tensor::TensorData;

/// The link between a device and host memory, bytes a second each way, measured by
/// [`measure_link`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Host to device.
    pub up: f64,
    /// Device to host.
    pub down: f64,
}

impl Link {
    /// The slower way: what a copy there and back is priced at.
    pub fn slower(&self) -> f64 {
        self.up.min(self.down)
    }
}

/// Measures the link between `device` and host memory: `bytes` of f32 copied up and read back,
/// the best of three (after a small copy each way, which readies the runtime's pools). `None`
/// where the backend's tensors are host memory (there is no link) or the device fails. On
/// Mesa's lavapipe, whose "device" memory is host memory, this is a memory copy through
/// Vulkan's staging buffers, not a bus.
pub fn measure_link<B: Backend>(device: &B::Device, bytes: usize) -> Option<Link> {
    use burn::tensor::Tensor;
    use std::time::Instant;
    if crate::nn::host_resident::<B>() != Some(false) {
        return None;
    }
    let elements = (bytes / 4).max(1);
    let once = |elements: usize| -> Option<(f64, f64)> {
        let data = TensorData::new(vec![1.0f32; elements], [elements]);
        let started = Instant::now();
        let tensor = Tensor::<B, 1>::from_data(data, device);
        B::sync(device).ok()?;
        let up = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let back = tensor.into_data();
        let down = started.elapsed().as_secs_f64();
        (back.num_elements() == elements).then_some((up, down))
    };
    once(1024)?;
    let mut best = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        let (up, down) = once(elements)?;
        best = (best.0.min(up), best.1.min(down));
    }
    let moved = (elements * 4) as f64;
    Some(Link {
        up: moved / best.0.max(1e-9),
        down: moved / best.1.max(1e-9),
    })
}
