//! The one memory meter: what the training log, the planner (its profile and its checks) and
//! the bench read of a device's memory. What each reading means on each device is stated here
//! once:
//!
//! | reading | CPU ([`AllocatorMeter`]) | CubeCL device ([`PoolReadings`]: CUDA, wgpu) |
//! |---|---|---|
//! | [`Meter::live`] | heap bytes live (the counting allocator) | bytes in use in the pools |
//! | [`Meter::peak`] | the most heap bytes live since [`Meter::reset_peak`] | the most bytes in use since [`Meter::reset_peak`]: a tracker reads the pools every half millisecond (CubeCL keeps no high-water mark of them) |
//! | [`Meter::window_peak`] | the most heap bytes live since the previous call | the most bytes in use at the readings taken since the previous call (the tracker's, from the first call on, and everyone's) |
//! | [`Meter::reserved`] | none | the pools' reserved bytes: an upper bound of the peak |
//! | [`Meter::gradients`], [`Meter::tags`] | bytes charged to backward's tag; per-tag bytes | not counted |

use std::sync::atomic::{AtomicU64, Ordering};

/// Reads a device's memory (see the module docs for what each reading means where).
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

    /// Bytes the device holds for its pools (reserved), where it has pools: an upper bound of
    /// [`Meter::peak`].
    fn reserved(&self) -> Option<u64> {
        None
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
        // New weights made by a step in backward are not gradients.
        let step = format!(".{}", super::phase::STEP);
        let half = format!(".{}", super::phase::HALF_WEIGHTS);
        Some(
            super::live_by_tag()
                .iter()
                .filter(|t| {
                    t.tag.starts_with(backward)
                        && !t.tag.contains(recompute)
                        && !t.tag.contains(&step)
                        && !t.tag.contains(&half)
                })
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
///
/// CubeCL 0.10 keeps no high-water mark of the bytes in use, so this meter keeps one: from
/// [`Meter::reset_peak`] until the meter is dropped, a tracker thread reads the pools about
/// every [`PoolReadings::INTERVAL`] (each reading waits for the device's queue to take every op
/// submitted before it), and every reading anyone takes (the log, the planner's windows) counts
/// too. The peak is the most bytes in use at any of them: every state of the pools between two
/// submitted ops can be read, and the peak of a step of more than a few milliseconds is. The
/// pools' reservation, an upper bound, is [`Meter::reserved`].
pub struct PoolReadings<F: Fn() -> Option<(u64, u64)> + Send + Sync + 'static> {
    shared: std::sync::Arc<Shared<F>>,
    tracker: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Shared<F> {
    usage: F,
    /// The most bytes in use seen at a reading since the window started.
    seen: AtomicU64,
    /// The most bytes in use seen at a reading since the peak was reset.
    high: AtomicU64,
    /// Readings taken (by anyone) since the peak was reset.
    readings: AtomicU64,
    stop: std::sync::atomic::AtomicBool,
}

impl<F: Fn() -> Option<(u64, u64)> + Send + Sync + 'static> Shared<F> {
    fn read(&self) -> Option<(u64, u64)> {
        let usage = (self.usage)();
        if let Some((used, _)) = usage {
            self.seen.fetch_max(used, Ordering::Relaxed);
            self.high.fetch_max(used, Ordering::Relaxed);
            self.readings.fetch_add(1, Ordering::Relaxed);
        }
        usage
    }
}

impl<F: Fn() -> Option<(u64, u64)> + Send + Sync + 'static> PoolReadings<F> {
    /// How often the tracker reads the pools.
    pub const INTERVAL: std::time::Duration = std::time::Duration::from_micros(500);

    /// A meter of the pools `usage` reads: `(bytes in use, bytes reserved)`.
    pub fn new(usage: F) -> Self {
        PoolReadings {
            shared: std::sync::Arc::new(Shared {
                usage,
                seen: AtomicU64::new(0),
                high: AtomicU64::new(0),
                readings: AtomicU64::new(0),
                stop: std::sync::atomic::AtomicBool::new(false),
            }),
            tracker: std::sync::Mutex::new(None),
        }
    }

    fn in_use(&self) -> u64 {
        self.shared.read().map_or(0, |(used, _)| used)
    }

    /// Readings taken since the peak was last reset (the tracker's and everyone's): how finely
    /// the peak was sampled.
    pub fn readings(&self) -> u64 {
        self.shared.readings.load(Ordering::Relaxed)
    }

    /// Starts the tracker thread if it is not running.
    fn track(&self) {
        let mut tracker = self.tracker.lock().unwrap_or_else(|e| e.into_inner());
        if tracker.is_some() {
            return;
        }
        let shared = self.shared.clone();
        *tracker = std::thread::Builder::new()
            .name("memsave-pool-meter".into())
            .spawn(move || {
                while !shared.stop.load(Ordering::Relaxed) {
                    shared.read();
                    std::thread::sleep(Self::INTERVAL);
                }
            })
            .ok();
    }
}

impl<F: Fn() -> Option<(u64, u64)> + Send + Sync + 'static> Drop for PoolReadings<F> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let tracker = self.tracker.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(tracker) = tracker.take() {
            let _ = tracker.join();
        }
    }
}

impl<F: Fn() -> Option<(u64, u64)> + Send + Sync + 'static> Meter for PoolReadings<F> {
    fn live(&self) -> u64 {
        self.in_use()
    }

    fn reset_peak(&self) -> u64 {
        let live = self.in_use();
        self.shared.high.store(live, Ordering::Relaxed);
        self.shared.readings.store(1, Ordering::Relaxed);
        self.track();
        live
    }

    fn peak(&self) -> u64 {
        let live = self.in_use();
        self.shared.high.load(Ordering::Relaxed).max(live)
    }

    fn window_peak(&self) -> u64 {
        // The windows are the tracker's readings too (the planner's profile, a step's meter).
        self.track();
        let live = (self.shared.usage)().map_or(0, |(used, _)| used);
        self.shared.high.fetch_max(live, Ordering::Relaxed);
        self.shared.seen.swap(live, Ordering::Relaxed).max(live)
    }

    fn reserved(&self) -> Option<u64> {
        (self.shared.usage)().map(|(_, reserved)| reserved)
    }
}

/// `meter` (a device's) as the calling thread's data-parallel peer sees it: on the CPU, where
/// the peers of one process share its heap, the bytes charged to the peer's slot
/// ([`super::SlotMeter`]: its training thread's and its helpers' blocks); elsewhere, and on a
/// thread of no peer, `meter` itself. Each runtime's `peer_meter_for` is this over its
/// `meter_for`.
pub fn for_peer(meter: Box<dyn Meter>) -> Box<dyn Meter> {
    let slot = super::thread_slot();
    if slot != 0 && meter.tags() {
        Box::new(super::SlotMeter(slot))
    } else {
        meter
    }
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
        assert_eq!(meter.peak(), 70, "the most in use since the reset");
        assert_eq!(meter.reserved(), Some(120), "the reservation");
    }

    #[test]
    fn a_pool_meters_windows_see_what_its_tracker_read() {
        let usage = std::sync::Arc::new(Mutex::new((10u64, 1000u64)));
        let reading = usage.clone();
        let meter = PoolReadings::new(move || Some(*reading.lock().unwrap()));
        assert_eq!(
            meter.window_peak(),
            10,
            "no reset_peak: the first window starts"
        );
        *usage.lock().unwrap() = (300, 1000);
        std::thread::sleep(PoolReadings::<fn() -> Option<(u64, u64)>>::INTERVAL * 40);
        *usage.lock().unwrap() = (20, 1000);
        assert_eq!(meter.window_peak(), 300, "the tracker read the spike");
    }

    #[test]
    fn a_pool_meters_tracker_catches_a_peak_no_one_else_read() {
        let usage = std::sync::Arc::new(Mutex::new((10u64, 1000u64)));
        let reading = usage.clone();
        let meter = PoolReadings::new(move || Some(*reading.lock().unwrap()));
        assert_eq!(meter.reset_peak(), 10);
        *usage.lock().unwrap() = (500, 1000);
        std::thread::sleep(PoolReadings::<fn() -> Option<(u64, u64)>>::INTERVAL * 40);
        *usage.lock().unwrap() = (20, 1000);
        assert_eq!(meter.peak(), 500, "the tracker read the spike");
        assert!(meter.readings() > 2, "{} readings", meter.readings());
        assert_eq!(meter.reset_peak(), 20, "a reset starts at the bytes in use");
        assert_eq!(meter.peak(), 20);
    }
}
