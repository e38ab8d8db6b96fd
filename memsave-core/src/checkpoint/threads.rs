//! The helper threads that recompute segments in backward.
//!
//! Burn 0.21 cannot run a `backward()` nested inside another on one thread: after the inner
//! backward, its clean-up locks every graph, the outer one included, which the same thread
//! holds. So a segment is recomputed, and back-propagated, on a helper thread; the outer
//! backward waits only for the gradients, which the helper sends as soon as they exist. The
//! helper then finishes its clean-up once the outer backward has released its lock.
//!
//! ## On CubeCL devices (CUDA, wgpu; CubeCL 0.10)
//!
//! CubeCL gives every thread a stream of its own: `StreamId::current()` is a thread-local id,
//! and each id maps to a CUDA stream of the device's pool. A buffer made on one stream and read
//! on another is ordered there too (on CUDA the reader waits on the producer's event; on wgpu,
//! whose streams share one queue, the producer's tasks are flushed to it first), but it costs
//! an event per crossing, the recomputation crosses at every input, parameter and output
//! gradient, and CubeCL 0.10 does not order a buffer's *reuse*: freed, it is free in its pool at
//! once, though another stream's queued kernels may still read it.
//!
//! memsave avoids the question: a helper runs on the stream of the thread that started it
//! (`StreamId::executes(outer, ..)`), so a recomputation's kernels are queued on the same CUDA
//! stream as the backward pass that waits for it, in the order the hand-off over the channel
//! gives them:
//! - what the helper reads (saved inputs, parameters, output gradients) was queued before the
//!   anchor's step started, on that stream: stream order makes it ready, with no event;
//! - what the outer backward reads afterwards (the gradients the taps send) was queued before
//!   the send, on that stream: ready for every kernel queued after the receive;
//! - a buffer the helper frees (its recomputed activations) goes back to the pool of that one
//!   stream, so its next user, on the same stream, runs after every kernel that used it.
//! No `sync` is needed for this; the outer backward does not run kernels while it waits, so one
//! stream loses no parallelism. Nested segments inherit the stream in turn. Burn's fusion
//! streams key on the same thread-local id, so they follow the same rule.
//!
//! Activation offload's copies are the exception ([`on_copy_stream`]): they cross streams on
//! purpose, once per offloaded input each way, so that on a GPU they run beside the compute, and
//! hold each prefetched buffer until a `sync` of the training stream has passed its readers
//! (see `offload`'s `Retained`).

use std::cell::Cell;
use std::sync::Mutex;
use std::thread::{JoinHandle, ThreadId};

/// The helpers not joined yet, each with the thread whose backward pass it serves (its owner):
/// peers of a data-parallel run train on threads of one process, and each joins its own.
static HELPERS: Mutex<Vec<(ThreadId, JoinHandle<()>)>> = Mutex::new(Vec::new());
thread_local! {
    static RECOMPUTATIONS: Cell<u64> = const { Cell::new(0) };
    /// On a helper: the thread that owns it (a nested helper inherits its parent's owner).
    static OWNER: Cell<Option<ThreadId>> = const { Cell::new(None) };
}

/// The thread whose backward pass the current thread serves (itself, unless a helper).
pub(crate) fn owner() -> ThreadId {
    OWNER
        .with(|owner| owner.get())
        .unwrap_or_else(|| std::thread::current().id())
}

/// How many segments the backward passes run on this thread have recomputed so far (for logs
/// and tests; a segment nested in another is counted on the thread that recomputes the outer).
pub fn recomputations() -> u64 {
    RECOMPUTATIONS.with(Cell::get)
}

/// Starts a helper thread, on the caller's device stream (see the module docs), and keeps its
/// handle.
pub(crate) fn spawn(work: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    RECOMPUTATIONS.with(|count| count.set(count.get() + 1));
    #[cfg(feature = "cubecl")]
    let work = {
        let stream = cubecl::stream_id::StreamId::current();
        move || stream.executes(work)
    };
    let owner = owner();
    let handle = std::thread::Builder::new()
        .name("memsave-recompute".into())
        .spawn(move || {
            OWNER.with(|cell| cell.set(Some(owner)));
            work()
        })?;
    lock().push((owner, handle));
    Ok(())
}

/// Runs `work` on a scoped helper thread, on the caller's device stream, and returns its result
/// (a panic in `work` is resumed on the caller).
pub(crate) fn run_on_helper<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    #[cfg(feature = "cubecl")]
    let work = {
        let stream = cubecl::stream_id::StreamId::current();
        move || stream.executes(work)
    };
    let owner = owner();
    let work = move || {
        OWNER.with(|cell| cell.set(Some(owner)));
        work()
    };
    std::thread::scope(|scope| match scope.spawn(work).join() {
        Ok(result) => result,
        Err(payload) => std::panic::resume_unwind(payload),
    })
}

/// `work` made to run, on another thread, on the *copy stream* of the caller's device stream
/// ([`copy_stream`]) and as a helper of the caller's owner: activation offload's copies to the
/// host and its prefetches ([`super::offload`]) run so, beside the compute rather than in its
/// queue. Where the runtime keeps one stream (`max_streams` 1), on the caller's stream; off
/// CubeCL, streams do not exist.
pub(crate) fn on_copy_stream<R>(
    work: impl FnOnce() -> R + Send + 'static,
) -> impl FnOnce() -> R + Send + 'static {
    #[cfg(feature = "cubecl")]
    let work = {
        let stream = cubecl::stream_id::StreamId::current();
        let copies = copy_stream_of(stream);
        if copies.is_some() {
            copies_used(stream);
        }
        let stream = copies.unwrap_or(stream);
        move || stream.executes(work)
    };
    let owner = owner();
    move || {
        OWNER.with(|cell| cell.set(Some(owner)));
        work()
    }
}

/// The stream activation offload's copies of the calling thread's work run on
/// ([`copy_stream_of`] its stream); `None` where the runtime keeps one stream.
#[cfg(feature = "cubecl")]
pub fn copy_stream() -> Option<cubecl::stream_id::StreamId> {
    copy_stream_of(cubecl::stream_id::StreamId::current())
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
#[cfg(feature = "cubecl")]
pub(crate) fn copy_stream_of(
    stream: cubecl::stream_id::StreamId,
) -> Option<cubecl::stream_id::StreamId> {
    use cubecl::config::RuntimeConfig;
    let slots = u64::from(
        cubecl::config::CubeClRuntimeConfig::get()
            .streaming
            .max_streams,
    );
    copy_id(stream.value, slots).map(|value| cubecl::stream_id::StreamId { value })
}

/// The id of the copy stream of the stream `stream` where the runtime keeps `slots` streams
/// (an id's slot is the id modulo `slots`). Ids count up from 0 as threads ask for one: the top
/// of the range is nobody's. A stream's copy stream is counted down from there (so that the
/// streams of a few peers have their copies in slots apart), or, where that falls in its own
/// slot, the next id down, far below (so that no other stream's is the same).
#[cfg_attr(not(feature = "cubecl"), allow(dead_code))]
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
#[cfg(feature = "cubecl")]
static COPIES_USED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

#[cfg(feature = "cubecl")]
fn copies_used(stream: cubecl::stream_id::StreamId) {
    let mut used = COPIES_USED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !used.contains(&stream.value) {
        used.push(stream.value);
    }
}

/// The copy stream of `stream` ([`copy_stream_of`]) where activation offload has used it: the
/// pools the pool meter reads beside `stream`'s.
#[cfg(feature = "cubecl")]
pub(crate) fn copy_stream_in_use(
    stream: cubecl::stream_id::StreamId,
) -> Option<cubecl::stream_id::StreamId> {
    let used = COPIES_USED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    used.contains(&stream.value)
        .then(|| copy_stream_of(stream))
        .flatten()
}

/// Frees this thread's matrix-product scratch (gemm's `L2_SLAB`, the size of the L2 cache). A
/// helper calls it when its last product is done: it stays alive, blocked, until the outer
/// backward ends, and would hold the scratch until then (2 MiB per recomputed segment here).
/// After it, no product may run on this thread: gemm would find no room in its scratch.
pub(crate) fn release_scratch() {
    let _ = gemm_common::gemm::L2_SLAB.try_with(|slab| {
        if let Ok(mut slab) = slab.try_borrow_mut() {
            *slab = dyn_stack::MemBuffer::new(dyn_stack::StackReq::empty());
        }
    });
}

/// Waits for every helper thread to end. Call it after `backward()` returned (the training
/// hooks do); never from inside a backward pass, whose lock the helpers wait for.
pub fn join_helpers() {
    let owner = owner();
    let handles: Vec<JoinHandle<()>> = {
        let mut helpers = lock();
        let (mine, others): (Vec<_>, Vec<_>) =
            helpers.drain(..).partition(|(who, _)| *who == owner);
        *helpers = others;
        mine.into_iter().map(|(_, handle)| handle).collect()
    };
    let count = handles.len();
    super::profile::joined(count, || {
        for handle in handles {
            // A helper that panicked has already reported it to the backward pass it served.
            let _ = handle.join();
        }
    });
    super::offload::release_retained(true);
}

/// Joins the helpers that have ended, without waiting for the others.
pub(crate) fn reap_finished() {
    let mut helpers = lock();
    let (done, running): (Vec<_>, Vec<_>) = helpers
        .drain(..)
        .partition(|(_, handle)| handle.is_finished());
    *helpers = running;
    drop(helpers);
    for (_, handle) in done {
        let _ = handle.join();
    }
}

/// How many helper threads have not been joined yet.
pub fn live_helpers() -> usize {
    lock().len()
}

fn lock() -> std::sync::MutexGuard<'static, Vec<(ThreadId, JoinHandle<()>)>> {
    // A poisoned list of handles is still a list of handles.
    HELPERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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
