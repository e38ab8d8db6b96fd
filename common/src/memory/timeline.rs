//! Live bytes across time: a sampler thread reads the counting allocator every interval, taking
//! the most live bytes since its previous sample (so that a peak between two samples is kept)
//! and the tag that was current (the phase: `forward`, `backward`, `step`, ...).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::allocator::take_window_peak;
use super::tags::{current_tag_id, tag_name};

/// One sample of a [`Timeline`].
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Seconds since the timeline started.
    pub seconds: f64,
    /// The most live heap bytes since the previous sample.
    pub bytes: usize,
    /// The tag path current at the sample (`""` outside every scope).
    pub tag: String,
}

/// A running sampler; [`Timeline::stop`] ends it and returns its samples.
pub struct Timeline {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Vec<(f64, usize, u32)>>>,
}

impl Timeline {
    /// Starts sampling every `interval`. Its buffer (room for `capacity` samples) is allocated
    /// here, before the first sample, so that sampling itself allocates nothing until it is
    /// full.
    pub fn start(interval: Duration, capacity: usize) -> std::io::Result<Timeline> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let mut samples: Vec<(f64, usize, u32)> = Vec::with_capacity(capacity);
        take_window_peak();
        let started = Instant::now();
        let handle = std::thread::Builder::new()
            .name("memsave-timeline".into())
            .spawn(move || loop {
                let done = flag.load(Ordering::Relaxed);
                let bytes = take_window_peak();
                samples.push((started.elapsed().as_secs_f64(), bytes, current_tag_id()));
                if done {
                    return samples;
                }
                std::thread::sleep(interval);
            })?;
        Ok(Timeline {
            stop,
            handle: Some(handle),
        })
    }

    /// Takes a last sample, ends the sampler and returns every sample, in time order.
    pub fn stop(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        let raw = self
            .handle
            .take()
            .and_then(|handle| handle.join().ok())
            .unwrap_or_default();
        let mut names: Vec<(u32, String)> = Vec::new();
        raw.into_iter()
            .map(|(seconds, bytes, id)| {
                let tag = match names.iter().find(|(known, _)| *known == id) {
                    Some((_, name)) => name.clone(),
                    None => {
                        let name = tag_name(id);
                        names.push((id, name.clone()));
                        name
                    }
                };
                Sample {
                    seconds,
                    bytes,
                    tag,
                }
            })
            .collect()
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
