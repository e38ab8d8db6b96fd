//! The memory pools of any CubeCL runtime (CUDA, wgpu, ROCm), and the streams activation
//! offload's copies run on (the pool meter reads their pools too).

use std::sync::Mutex;

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
    if let Some(copies) = copy_stream_in_use(StreamId::current()) {
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
    // Where Burn's runtime itself panics (no driver, no adapter): the probe's one question, its
    // panic turned into the runtime's words.
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

/// The stream activation offload's copies of the calling thread's work run on
/// ([`copy_stream_of`] its stream); `None` where the runtime keeps one stream.
pub fn copy_stream() -> Option<StreamId> {
    copy_stream_of(StreamId::current())
}

/// The stream activation offload's copies of the work of `stream` run on: one per training
/// stream (a data-parallel peer has its own), so that the copies have a queue of their own (on
/// CUDA a stream of the device's pool, which runs beside the compute) and their buffers a pool
/// of their own. CubeCL orders a buffer made on one stream and read on the other, not its reuse
/// once freed (see the module docs): activation offload holds what it prefetched until the
/// training stream is past it. Its id is one no thread is given (threads count up from 0), one
/// for each `stream` (peers do not share one), that the runtime maps to another slot of its
/// pool than `stream`'s (with more streams than slots, two may share a slot, as CubeCL's own
/// streams do); `None` where the runtime keeps one stream.
pub(crate) fn copy_stream_of(stream: StreamId) -> Option<StreamId> {
    use cubecl::config::RuntimeConfig;
    let slots = u64::from(
        cubecl::config::CubeClRuntimeConfig::get()
            .streaming
            .max_streams,
    );
    copy_id(stream.value, slots).map(|value| StreamId { value })
}

/// The id of the copy stream of the stream `stream` where the runtime keeps `slots` streams
/// (an id's slot is the id modulo `slots`). Ids count up from 0 as threads ask for one: the top
/// of the range is nobody's. A stream's copy stream is counted down from there (so that the
/// streams of a few peers have their copies in slots apart), or, where that falls in its own
/// slot, the next id down, far below (so that no other stream's is the same).
fn copy_id(stream: u64, slots: u64) -> Option<u64> {
    if slots < 2 {
        return None;
    }
    let down = u64::MAX.wrapping_sub(stream);
    Some(if down % slots != stream % slots {
        down
    } else {
        down.wrapping_sub(1).wrapping_sub(slots << 32)
    })
}

/// The training streams whose copy stream has been used (the pool meter reads those too).
static COPIES_USED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

pub(crate) fn copies_used(stream: StreamId) {
    let mut used = COPIES_USED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !used.contains(&stream.value) {
        used.push(stream.value);
    }
}

/// The copy stream of `stream` ([`copy_stream_of`]) where activation offload has used it: the
/// pools the pool meter reads beside `stream`'s.
pub(crate) fn copy_stream_in_use(stream: StreamId) -> Option<StreamId> {
    let used = COPIES_USED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    used.contains(&stream.value)
        .then(|| copy_stream_of(stream))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::copy_id;

    /// A copy stream's slot is never its stream's, no two streams share a copy stream, and no
    /// thread's id (counted up from 0) is one.
    #[test]
    fn each_stream_has_a_copy_stream_of_its_own_in_another_slot() {
        for slots in [2u64, 3, 5, 7, 128, 255] {
            let mut seen = std::collections::HashSet::new();
            for stream in 0..1000u64 {
                let copy = copy_id(stream, slots).expect("many slots");
                assert_ne!(
                    copy % slots,
                    stream % slots,
                    "slots {slots}, stream {stream}"
                );
                assert!(copy > 1 << 40, "slots {slots}, stream {stream}: {copy}");
                assert!(seen.insert(copy), "slots {slots}: {copy} twice");
            }
        }
        // CubeCL's default: the first streams' copies in slots of their own.
        let slots: std::collections::HashSet<u64> = (0..128)
            .map(|stream| copy_id(stream, 128).unwrap() % 128)
            .collect();
        assert_eq!(slots.len(), 128);
        assert_eq!(copy_id(3, 1), None, "one stream: no copy stream");
        assert_eq!(copy_id(3, 0), None);
    }
}
