//! One run, one context: the state a training run switches and counts (activation offload's
//! setting, host limit and figures, the step's failures, the warnings said once, profiling's
//! recorder, the `#[with_cp]` types that ran) lives in a [`RunContext`] the run owns, not in
//! the process. Two runs in one process (tests on parallel threads, a sweep, a service) each see
//! their own.
//!
//! The shape of tokio's runtime handle and of PyTorch's `saved_tensors_hooks`: a run installs
//! its context on the thread that trains ([`RunContext::enter`], a guard removes it), and code
//! deep inside a step (a `#[with_cp]` segment, activation offload's copier) reaches it through
//! that thread-local ([`current`]). The threads memsave starts for a run (recompute helpers,
//! copiers, prefetchers, data-parallel peers) inherit it explicitly ([`inherit`]).
//!
//! Who owns one: memsave's runner (its own, or the one installed where it is made),
//! burn-train's adapter (`Memsave`), the check of `#[with_cp]` switches, and, in a user's own loop, the user:
//!
//! ```ignore
//! let run = memsave::RunContext::named("sweep lr=0.1");
//! run.scope(|| -> memsave::Result<()> {
//!     memsave::checkpoint::set_activation_offload(Some(Default::default()));
//!     for (iter, batch) in batches.enumerate() {
//!         let grads = model.forward(batch).backward();
//!         memsave::checkpoint::join_helpers()?;     // the step's failures, as an `Error`
//!         if iter == 0 {
//!             memsave::check::segments_ran(&model)?;  // a block switched on with no segment
//!         }
//!         // ... the optimizer's step
//!     }
//!     Ok(())
//! })??;
//! ```
//!
//! A thread where nothing is installed has a context of its own, made on first use (its
//! *ambient* context): code that never names a run still gets one per thread, never one per
//! process.
//!
//! Each part of memsave keeps its per-run state as a value of a type of its own, made on first
//! use ([`RunContext::part`]): this module knows none of them, so no part's import leads back
//! here.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::{Error, Result};

/// The state of one run (see the [module docs](self)). Cloning it gives another handle to the
/// same run.
#[derive(Clone)]
pub struct RunContext {
    inner: Arc<Inner>,
}

struct Inner {
    id: u64,
    name: String,
    ended: AtomicBool,
    /// Each part's state, by its type.
    parts: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    /// The failure that ended the step of each training thread (a data-parallel peer is one),
    /// until it is taken.
    failures: Mutex<HashMap<ThreadId, Error>>,
    /// What was said once already (warnings, notices), by key.
    said: Mutex<HashSet<String>>,
}

impl fmt::Debug for RunContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunContext")
            .field("id", &self.inner.id)
            .field("name", &self.inner.name)
            .field("ended", &self.is_ended())
            .finish()
    }
}

impl PartialEq for RunContext {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for RunContext {}

fn next_id() -> u64 {
    // Ids only tell runs apart in messages: process-wide by nature.
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // What a panicking holder left is still the run's state: a step it ended is abandoned.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Default for RunContext {
    fn default() -> Self {
        Self::new()
    }
}

impl RunContext {
    /// A new run's context, named `run N` in messages.
    pub fn new() -> Self {
        let id = next_id();
        Self::with_id(id, format!("run {id}"))
    }

    /// A new run's context, named `name` in messages (`"sweep lr=0.1"`).
    pub fn named(name: impl Into<String>) -> Self {
        Self::with_id(next_id(), name.into())
    }

    fn with_id(id: u64, name: String) -> Self {
        RunContext {
            inner: Arc::new(Inner {
                id,
                name,
                ended: AtomicBool::new(false),
                parts: Mutex::new(HashMap::new()),
                failures: Mutex::new(HashMap::new()),
                said: Mutex::new(HashSet::new()),
            }),
        }
    }

    /// Its name in messages: the one given, or `run N`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Installs the run on this thread until the guard is dropped: the code of a step run here
    /// (and on the threads memsave starts from here) reads and counts into it. Entering a run
    /// already installed here nests. Errors, naming both runs, where another run is installed
    /// on this thread, and where this run has ended ([`RunContext::end`]).
    pub fn enter(&self) -> Result<Entered> {
        if self.is_ended() {
            return Err(Error::RunEnded {
                run: self.name().to_string(),
            });
        }
        HERE.with(|here| {
            let mut here = here.borrow_mut();
            if let Some(top) = here.stack.last() {
                if top.context != *self {
                    return Err(Error::RunInstalled {
                        installed: top.context.name().to_string(),
                        entering: self.name().to_string(),
                    });
                }
            }
            here.stack.push(Installed {
                context: self.clone(),
                owner: std::thread::current().id(),
            });
            Ok(Entered {
                _not_send: PhantomData,
            })
        })
    }

    /// Runs `f` with the run installed on this thread ([`RunContext::enter`]).
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let _entered = self.enter()?;
        Ok(f())
    }

    /// Ends the run: it can no longer be entered. Its figures stay readable.
    pub fn end(&self) {
        self.inner.ended.store(true, Ordering::SeqCst);
    }

    /// Whether [`RunContext::end`] was called.
    pub fn is_ended(&self) -> bool {
        self.inner.ended.load(Ordering::SeqCst)
    }

    /// The run's state of the part `T` (one value per type, made with `T::default()` on first
    /// use). For memsave's parts: each keeps its own state type private.
    pub fn part<T: Any + Default + Send + Sync>(&self) -> Arc<T> {
        let mut parts = lock(&self.inner.parts);
        let part = parts
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()));
        part.clone()
            .downcast::<T>()
            .expect("a part is stored under its own type's id")
    }

    /// Records `error` as the failure that ends the step of the training thread `owner`: the
    /// first one counts (what follows from it is not the cause). Read by [`take_failure`].
    #[doc(hidden)]
    pub fn fail_on(&self, owner: ThreadId, error: Error) {
        lock(&self.inner.failures).entry(owner).or_insert(error);
    }

    /// Whether the step of the training thread `owner` has failed.
    #[doc(hidden)]
    pub fn has_failed_on(&self, owner: ThreadId) -> bool {
        lock(&self.inner.failures).contains_key(&owner)
    }

    /// The failure of the training thread `owner`'s step, taken.
    #[doc(hidden)]
    pub fn take_failure_of(&self, owner: ThreadId) -> Option<Error> {
        lock(&self.inner.failures).remove(&owner)
    }

    /// Whether `key` is said for the first time in this run (then it is noted).
    pub fn first_time(&self, key: &str) -> bool {
        lock(&self.inner.said).insert(key.to_string())
    }
}

/// The guard of [`RunContext::enter`]: the run is removed from the thread when it is dropped (on
/// the thread that entered it: it is not `Send`).
#[must_use = "the run is installed only while the guard lives"]
pub struct Entered {
    _not_send: PhantomData<*const ()>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        HERE.with(|here| here.borrow_mut().stack.pop());
    }
}

/// A run installed on a thread, with the training thread the work there serves.
struct Installed {
    context: RunContext,
    /// The thread whose step this thread's work belongs to: itself, or, on a thread memsave
    /// started for a step (a recompute helper, a copier), the training thread that started it.
    owner: ThreadId,
}

#[derive(Default)]
struct Here {
    stack: Vec<Installed>,
    /// The thread's own run, where none is installed.
    ambient: Option<RunContext>,
}

thread_local! {
    static HERE: RefCell<Here> = RefCell::new(Here::default());
}

/// The run installed on this thread; where none is, the thread's own (made on first use).
pub fn current() -> RunContext {
    HERE.with(|here| {
        let mut here = here.borrow_mut();
        if let Some(top) = here.stack.last() {
            return top.context.clone();
        }
        here.ambient
            .get_or_insert_with(|| {
                let id = next_id();
                let thread = std::thread::current();
                RunContext::with_id(
                    id,
                    format!(
                        "run {id} (the own run of thread `{}`)",
                        thread.name().unwrap_or("unnamed")
                    ),
                )
            })
            .clone()
    })
}

/// The run installed on this thread by [`RunContext::enter`] or inherited ([`inherit`]), if any
/// (not the thread's own ambient run).
pub fn installed() -> Option<RunContext> {
    HERE.with(|here| here.borrow().stack.last().map(|top| top.context.clone()))
}

/// The training thread whose step the calling thread's work belongs to (itself, unless a thread
/// memsave started for a step).
#[doc(hidden)]
pub fn owner() -> ThreadId {
    HERE.with(|here| {
        here.borrow()
            .stack
            .last()
            .map_or_else(|| std::thread::current().id(), |top| top.owner)
    })
}

/// Records `error` as the failure that ends the calling training thread's step, in the current
/// run: the first one counts. The step goes on as far as it must (a forward ends; a backward
/// skips the recomputations left) and [`take_failure`] hands the error to whoever drives the
/// step (the runner, through `checkpoint::join_helpers`).
#[doc(hidden)]
pub fn fail(error: Error) {
    current().fail_on(owner(), error);
}

/// Whether the calling training thread's step has failed ([`fail`]).
#[doc(hidden)]
pub fn has_failed() -> bool {
    current().has_failed_on(owner())
}

/// The failure that ended the calling training thread's step, if any, taken.
pub fn take_failure() -> Option<Error> {
    current().take_failure_of(owner())
}

/// What a thread memsave starts for a step needs of the one that starts it: the run and the
/// training thread it serves ([`inherit`]).
#[derive(Clone)]
#[doc(hidden)]
pub struct Inherited {
    context: RunContext,
    owner: ThreadId,
    /// The memory slot of the training thread's peer (see [`crate::memory::SlotMeter`]).
    slot: u32,
}

/// The run and training thread of the calling thread, for a thread it starts
/// ([`Inherited::install`] there).
#[doc(hidden)]
pub fn inherit() -> Inherited {
    Inherited {
        context: current(),
        owner: owner(),
        slot: crate::memory::thread_slot(),
    }
}

impl Inherited {
    /// Installs the inherited run on this (new) thread for the life of the guard.
    #[doc(hidden)]
    pub fn install(self) -> InheritedGuard {
        let slot = crate::memory::set_thread_slot(self.slot);
        HERE.with(|here| {
            here.borrow_mut().stack.push(Installed {
                context: self.context,
                owner: self.owner,
            })
        });
        InheritedGuard {
            slot,
            _not_send: PhantomData,
        }
    }

    /// Installs the inherited run on this (new) thread as a training thread of its own (a
    /// data-parallel peer: its steps, helpers and failures are its own, not the spawner's),
    /// its blocks charged to the memory slot `slot` (0: the spawner's).
    #[doc(hidden)]
    pub fn install_as_owner(self, slot: u32) -> InheritedGuard {
        let slot = if slot == 0 { self.slot } else { slot };
        Inherited {
            owner: std::thread::current().id(),
            slot,
            ..self
        }
        .install()
    }

    /// `work`, made to run inside the inherited run on whatever thread calls it.
    #[doc(hidden)]
    pub fn wrap<R>(self, work: impl FnOnce() -> R) -> impl FnOnce() -> R {
        move || {
            let _installed = self.install();
            work()
        }
    }

    /// The inherited run.
    #[doc(hidden)]
    pub fn context(&self) -> &RunContext {
        &self.context
    }
}

/// The guard of [`Inherited::install`].
#[doc(hidden)]
pub struct InheritedGuard {
    /// The slot the thread had before.
    slot: u32,
    _not_send: PhantomData<*const ()>,
}

impl Drop for InheritedGuard {
    fn drop(&mut self) {
        crate::memory::set_thread_slot(self.slot);
        HERE.with(|here| here.borrow_mut().stack.pop());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Counter(std::sync::atomic::AtomicUsize);

    #[test]
    fn each_run_keeps_its_own_parts_and_threads_started_inherit_it() {
        let a = RunContext::named("a");
        let b = RunContext::named("b");
        a.scope(|| {
            current()
                .part::<Counter>()
                .0
                .fetch_add(3, Ordering::Relaxed)
        })
        .unwrap();
        b.scope(|| {
            current()
                .part::<Counter>()
                .0
                .fetch_add(5, Ordering::Relaxed)
        })
        .unwrap();
        assert_eq!(a.part::<Counter>().0.load(Ordering::Relaxed), 3);
        assert_eq!(b.part::<Counter>().0.load(Ordering::Relaxed), 5);
        let seen = a
            .scope(|| {
                let inherited = inherit();
                std::thread::spawn(move || inherited.wrap(|| current().name().to_string())())
                    .join()
                    .unwrap()
            })
            .unwrap();
        assert_eq!(seen, "a");
        // A thread with nothing installed has a run of its own.
        let other = std::thread::spawn(current).join().unwrap();
        assert_ne!(other, a);
        assert_ne!(other, current());
    }

    #[test]
    fn a_second_run_on_a_thread_or_an_ended_one_is_an_error_naming_both() {
        let a = RunContext::named("first");
        let b = RunContext::named("second");
        let _in_a = a.enter().unwrap();
        let nested = a.enter().expect("the same run nests");
        drop(nested);
        let error = b
            .enter()
            .err()
            .expect("another run is installed")
            .to_string();
        assert!(
            error.contains("`first`") && error.contains("`second`"),
            "{error}"
        );
        assert_eq!(current(), a, "the installed run is left as it was");
        b.end();
        drop(_in_a);
        let error = b.enter().err().expect("it ended").to_string();
        assert!(
            error.contains("`second`") && error.contains("ended"),
            "{error}"
        );
    }

    #[test]
    fn a_failure_belongs_to_its_training_thread_and_the_first_counts() {
        let run = RunContext::new();
        run.scope(|| {
            fail(Error::invalid("a", "first"));
            fail(Error::invalid("b", "second"));
            let inherited = inherit();
            let elsewhere = std::thread::spawn(move || {
                let _in = inherited.install();
                // A helper of this thread sees its owner's failure.
                has_failed()
            })
            .join()
            .unwrap();
            assert!(elsewhere);
            let other_owner = std::thread::spawn({
                let run = run.clone();
                move || run.scope(has_failed).unwrap()
            })
            .join()
            .unwrap();
            assert!(
                !other_owner,
                "another training thread of the run has its own"
            );
            let taken = take_failure().expect("recorded").to_string();
            assert!(taken.contains("`a`"), "{taken}");
            assert!(take_failure().is_none());
        })
        .unwrap();
    }
}
