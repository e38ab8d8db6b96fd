//! The helper threads that recompute segments in backward.
//!
//! Burn 0.21 cannot run a `backward()` nested inside another on one thread: after the inner
//! backward, its clean-up locks every graph, the outer one included, which the same thread
//! holds. So a segment is recomputed, and back-propagated, on a helper thread; the outer
//! backward waits only for the gradients, which the helper sends as soon as they exist. The
//! helper then finishes its clean-up once the outer backward has released its lock.

use std::cell::Cell;
use std::sync::Mutex;
use std::thread::JoinHandle;

static HELPERS: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());
thread_local! {
    static RECOMPUTATIONS: Cell<u64> = const { Cell::new(0) };
}

/// How many segments the backward passes run on this thread have recomputed so far (for logs
/// and tests; a segment nested in another is counted on the thread that recomputes the outer).
pub fn recomputations() -> u64 {
    RECOMPUTATIONS.with(Cell::get)
}

/// Starts a helper thread and keeps its handle.
pub(crate) fn spawn(work: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    RECOMPUTATIONS.with(|count| count.set(count.get() + 1));
    let handle = std::thread::Builder::new()
        .name("memsave-recompute".into())
        .spawn(work)?;
    lock().push(handle);
    Ok(())
}

/// Waits for every helper thread to end. Call it after `backward()` returned (the training
/// hooks do); never from inside a backward pass, whose lock the helpers wait for.
pub fn join_helpers() {
    let handles = std::mem::take(&mut *lock());
    for handle in handles {
        // A helper that panicked has already reported it to the backward pass it served.
        let _ = handle.join();
    }
}

/// Joins the helpers that have ended, without waiting for the others.
pub(crate) fn reap_finished() {
    let mut helpers = lock();
    let (done, running): (Vec<_>, Vec<_>) =
        helpers.drain(..).partition(|handle| handle.is_finished());
    *helpers = running;
    drop(helpers);
    for handle in done {
        let _ = handle.join();
    }
}

/// How many helper threads have not been joined yet.
pub fn live_helpers() -> usize {
    lock().len()
}

fn lock() -> std::sync::MutexGuard<'static, Vec<JoinHandle<()>>> {
    // A poisoned list of handles is still a list of handles.
    HELPERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
