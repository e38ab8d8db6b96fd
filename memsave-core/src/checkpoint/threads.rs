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
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, ThreadId};

use crate::run;

/// The helpers of a run not joined yet, each with the training thread whose backward pass it
/// serves (its owner): peers of a data-parallel run train on threads of one process, and each
/// joins its own.
#[derive(Default)]
struct Helpers(Mutex<Vec<(ThreadId, JoinHandle<()>)>>);

thread_local! {
    static RECOMPUTATIONS: Cell<u64> = const { Cell::new(0) };
}

/// How many segments the backward passes run on this thread have recomputed so far (for logs
/// and tests; a segment nested in another is counted on the thread that recomputes the outer).
pub fn recomputations() -> u64 {
    RECOMPUTATIONS.with(Cell::get)
}

/// Starts a helper thread, in the caller's run and on its device stream (see the module docs),
/// and keeps its handle.
pub(crate) fn spawn(work: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    RECOMPUTATIONS.with(|count| count.set(count.get() + 1));
    #[cfg(feature = "cubecl")]
    let work = {
        let stream = cubecl::stream_id::StreamId::current();
        move || stream.executes(work)
    };
    let inherited = run::inherit();
    let helpers = inherited.context().part::<Helpers>();
    let owner = run::owner();
    let handle = std::thread::Builder::new()
        .name("memsave-recompute".into())
        .spawn(inherited.wrap(work))?;
    lock(&helpers).push((owner, handle));
    Ok(())
}

/// Runs `work` on a scoped helper thread, in the caller's run and on its device stream, and
/// returns its result (a panic in `work`, the user's segment code, is resumed on the caller: a
/// thread boundary).
pub(crate) fn run_on_helper<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    #[cfg(feature = "cubecl")]
    let work = {
        let stream = cubecl::stream_id::StreamId::current();
        move || stream.executes(work)
    };
    let work = run::inherit().wrap(work);
    std::thread::scope(|scope| match scope.spawn(work).join() {
        Ok(result) => result,
        Err(payload) => std::panic::resume_unwind(payload),
    })
}

/// `work` made to run on the *copy stream* of the caller's device stream
/// ([`crate::memory::cube::copy_stream_of`]): activation offload's copies to the host and its
/// prefetches ([`super::offload`]) run so, on threads of their own that inherit the caller's
/// run, beside the compute rather than in its queue. Where the runtime keeps one stream
/// (`max_streams` 1), on the caller's stream; off CubeCL, streams do not exist.
pub(crate) fn on_copy_stream<R>(
    work: impl FnOnce() -> R + Send + 'static,
) -> impl FnOnce() -> R + Send + 'static {
    #[cfg(feature = "cubecl")]
    let work = {
        use crate::memory::cube;
        let stream = cubecl::stream_id::StreamId::current();
        let copies = cube::copy_stream_of(stream);
        if copies.is_some() {
            cube::copies_used(stream);
        }
        let stream = copies.unwrap_or(stream);
        move || stream.executes(work)
    };
    work
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

/// Joins the helper threads of the calling training thread in the current run (see
/// [`super::join_helpers`], which also ends the step's offload and takes its failure).
pub(crate) fn join_mine() {
    let helpers = run::current().part::<Helpers>();
    let owner = run::owner();
    let handles: Vec<JoinHandle<()>> = {
        let mut helpers = lock(&helpers);
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
}

/// Joins the helpers of the current run that have ended, without waiting for the others.
pub(crate) fn reap_finished() {
    let helpers = run::current().part::<Helpers>();
    let mut helpers = lock(&helpers);
    let (done, running): (Vec<_>, Vec<_>) = helpers
        .drain(..)
        .partition(|(_, handle)| handle.is_finished());
    *helpers = running;
    drop(helpers);
    for (_, handle) in done {
        let _ = handle.join();
    }
}

/// How many helper threads of the current run have not been joined yet.
pub fn live_helpers() -> usize {
    lock(&run::current().part::<Helpers>()).len()
}

fn lock(helpers: &Arc<Helpers>) -> std::sync::MutexGuard<'_, Vec<(ThreadId, JoinHandle<()>)>> {
    // A poisoned list of handles is still a list of handles.
    helpers
        .0
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
