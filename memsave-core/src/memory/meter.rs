//! The one memory meter: what the training log, the planner (its profile and its checks) and
//! the bench read of a device's memory. What each reading means on each device is stated here
//! once:
//!
//! | reading | CPU ([`AllocatorMeter`]) | CubeCL device (CUDA: `cuda::PoolMeter`) |
//! |---|---|---|
//! | [`Meter::live`] | heap bytes live (the counting allocator) | bytes in use in the pools |
//! | [`Meter::peak`] | the most heap bytes live since [`Meter::reset_peak`] | the pools' reserved bytes: their high-water mark, an upper bound of the bytes in use (CubeCL keeps no resettable high-water mark of them) |
//! | [`Meter::window_peak`] | the most heap bytes live since the previous call | the most bytes in use at the readings taken since the previous call: a lower bound |
//! | [`Meter::gradients`], [`Meter::tags`] | bytes charged to backward's tag; per-tag bytes | not counted |

use std::sync::atomic::{AtomicU64, Ordering};

/// Reads a device's memory (see the [module docs](self) for what each reading means where).
pub trait Meter: Send + Sync {
    /// Bytes live now.
    fn live(&self) -> u64;

    /// Starts a new peak at the live bytes now, and returns them (the baseline).
    fn reset_peak(&self) -> u64;

    /// The peak since [`Meter::reset_peak`].
    fn peak(&self) -> u64;

    /// The most bytes live since the previous call (or since the meter was made), starting a
    /// new window: the planner's profile splits a step into windows with it.
    fn window_peak(&self) -> u64;

    /// Bytes live now under the backward pass's tag (gradients), where tags are counted.
    fn gradients(&self) -> Option<u64> {
        None
    }

    /// Whether bytes are charged to tags (phases and layers: [`super::live_by_tag`],
    /// [`super::peak_by_tag`]), for the breakdown and the timeline.
    fn tags(&self) -> bool {
        false
    }
}

/// The counting allocator ([`super::CountingAllocator`]), which must be installed.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocatorMeter;

impl Meter for AllocatorMeter {
    fn live(&self) -> u64 {
        super::current_bytes() as u64
    }

    fn reset_peak(&self) -> u64 {
        super::reset_peak() as u64
    }

    fn peak(&self) -> u64 {
        super::peak_bytes() as u64
    }

    fn window_peak(&self) -> u64 {
        super::take_window_peak() as u64
    }

    fn gradients(&self) -> Option<u64> {
        let backward = super::phase::BACKWARD;
        let recompute = super::phase::RECOMPUTE;
        Some(
            super::live_by_tag()
                .iter()
                .filter(|t| t.tag.starts_with(backward) && !t.tag.contains(recompute))
                .map(|t| t.live.max(0) as u64)
                .sum(),
        )
    }

    fn tags(&self) -> bool {
        super::is_counting()
    }
}

/// A device whose pools report bytes in use and reserved (`usage()`: `None` when the runtime
/// cannot say): the readings of a CubeCL device.
pub struct PoolReadings<F: Fn() -> Option<(u64, u64)> + Send + Sync> {
    usage: F,
    /// The most bytes in use seen at a reading since the window started.
    seen: AtomicU64,
}

impl<F: Fn() -> Option<(u64, u64)> + Send + Sync> PoolReadings<F> {
    /// A meter of the pools `usage` reads: `(bytes in use, bytes reserved)`.
    pub fn new(usage: F) -> Self {
        PoolReadings {
            usage,
            seen: AtomicU64::new(0),
        }
    }

    fn in_use(&self) -> u64 {
        let live = (self.usage)().map_or(0, |(used, _)| used);
        self.seen.fetch_max(live, Ordering::Relaxed);
        live
    }
}

impl<F: Fn() -> Option<(u64, u64)> + Send + Sync> Meter for PoolReadings<F> {
    fn live(&self) -> u64 {
        self.in_use()
    }

    fn reset_peak(&self) -> u64 {
        self.in_use()
    }

    fn peak(&self) -> u64 {
        (self.usage)().map_or(0, |(_, reserved)| reserved)
    }

    fn window_peak(&self) -> u64 {
        let live = (self.usage)().map_or(0, |(used, _)| used);
        self.seen.swap(live, Ordering::Relaxed).max(live)
    }
}

/// The meter of `device`: its pools on CUDA (feature `cuda`), the counting allocator on the
/// CPU when it is installed; `None` where neither can be read.
pub fn meter_for<D: 'static>(device: &D) -> Option<Box<dyn Meter>> {
    #[cfg(feature = "cuda")]
    if let Some(device) = (device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>()
    {
        return Some(Box::new(super::cuda::pool_meter(device.clone())));
    }
    let _ = device;
    super::is_counting().then(|| Box::new(AllocatorMeter) as Box<dyn Meter>)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_pool_meters_window_is_the_most_in_use_seen_and_its_peak_the_reservation() {
        let usage = std::sync::Arc::new(Mutex::new((10u64, 100u64)));
        let reading = usage.clone();
        let meter = PoolReadings::new(move || Some(*reading.lock().unwrap()));
        assert_eq!(meter.reset_peak(), 10);
        *usage.lock().unwrap() = (70, 100);
        assert_eq!(meter.live(), 70);
        *usage.lock().unwrap() = (20, 120);
        assert_eq!(
            meter.window_peak(),
            70,
            "the most seen since the window started"
        );
        assert_eq!(
            meter.window_peak(),
            20,
            "a new window starts at the bytes in use"
        );
        assert_eq!(meter.peak(), 120, "the reservation");
    }
}
