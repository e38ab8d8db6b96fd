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
//! on another is safe there too (the server flushes the producing stream and makes the reader
//! wait on its event, and defers the buffer's release to a GC thread until that event is
//! reached), but it costs an event per crossing, and the recomputation crosses at every input,
//! parameter and output gradient.
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
//! No `sync` is needed anywhere; the outer backward does not run kernels while it waits, so one
//! stream loses no parallelism. Nested segments inherit the stream in turn. Burn's fusion
//! streams key on the same thread-local id, so they follow the same rule.
//!
//! Activation offload's copies are the exception ([`on_copy_stream`]): they cross streams on
//! purpose, once per offloaded input each way, so that on a GPU they run beside the compute.

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
/// of their own. CubeCL orders a buffer made on one stream and read on the other (the reader
/// waits on the maker's event; the buffer is released once the reader's event is reached). Its
/// id is one the runtime maps to another slot of its pool than `stream`'s; `None` where the
/// runtime keeps one stream.
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
    if slots < 2 {
        return None;
    }
    // Ids count up from 0 as threads ask for one: the top of the range is nobody's, and maps
    // to a slot of its own unless it falls on `stream`'s.
    let mut value = u64::MAX - stream.value;
    if value % slots == stream.value % slots {
        value -= 1;
    }
    Some(cubecl::stream_id::StreamId { value })
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
