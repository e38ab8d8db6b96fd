//! Activation offload, the first half of CPU staging: the input a checkpointed segment keeps
//! for its recomputation goes to host memory during the forward and comes back before the
//! recomputation in backward, prefetched (PyTorch's `save_on_cpu`, torchtune's
//! `OffloadActivations`, DeepSpeed's `cpu_checkpointing`). With every block checkpointed, what a
//! model keeps between forward and backward is each segment's input; offloaded, the device
//! holds little more than the segment being recomputed.
//!
//! Forward: the float inputs of a checkpointed segment of at least
//! [`ActivationOffload::min_bytes`] are taken out of the anchor (a one-element placeholder stays
//! in each one's place, its graph node untouched) and handed to a copier thread, which reads
//! them into host memory and then drops the device copies. Until a copy is done, its device
//! bytes are *in flight*: past [`ActivationOffload::max_in_flight`] the forward waits for the
//! copies under way. A copy that has not started when backward reaches its segment is cancelled
//! (the device copy is used as is).
//!
//! Backward: the anchor of a segment takes its inputs back before it recomputes (ready if a
//! prefetch brought them, else copied up now), then starts bringing back the
//! [`ActivationOffload::prefetch`] segments that precede it in the forward, each on a helper
//! thread, so that their copies overlap its recomputation. The values are the same bytes: the
//! gradients are bit-identical to a run without offload.
//!
//! Streams (CubeCL): the copies (to the host in the forward, the prefetches back in backward)
//! run on a stream of their own, the training stream's copy stream ([`super::copy_stream`]; a
//! data-parallel peer has its own), so that on a GPU they queue beside the compute rather than
//! in it. CubeCL orders each buffer's first crossing: a copy to the host runs after the training
//! stream's kernels that made its input, and a recomputation after the prefetch that brought its
//! input back. It does not order a freed buffer's reuse, so each prefetch a recomputation takes
//! is held until the training stream is past it (`Retained`). The pool meter reads the copy
//! stream's pools beside the training stream's ([`crate::memory::cube::pool_usage`]), so the
//! prefetched inputs count as the device holds them. A copy back that the recomputation asks for
//! itself (no prefetch brought it) runs on the training stream, which waits for it anyway. Host
//! buffers are ordinary (pageable) memory: Burn 0.21 has no pinned allocation.
//!
//! Not offloaded: segments nested in another's recomputation (their inputs are made in
//! backward and used at once), and what a segment that is not checkpointed keeps for backward
//! (Burn 0.21's autodiff keeps it inside its own nodes' states, which memsave cannot reach).
//! On a backend whose tensors are host memory already (Flex), offload has nothing to save: it
//! says so once and does nothing.
//!
//! Per run: the setting, the host limit and the figures belong to the run installed on the
//! thread ([`crate::run`]); two runs in one process each see their own. The copier and prefetch
//! threads inherit the run of the thread that starts them.
//!
//! Failures are values, not panics: past the host limit ([`set_host_limit`], the runner's
//! `[memory] host_budget`) a segment keeps its input on the device and the step's failure is
//! recorded ([`crate::run`]); a copy back that fails (a device lost during a prefetch) is
//! recorded the same way, and the backward skips the recomputations left. Each names the
//! segment (its type, method and place in the forward); the runner, or a user's loop through
//! [`crate::checkpoint::join_helpers`], gets it as an [`crate::Error`] that says what to change.

mod link;
mod slot;
mod stage;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, Weak};
use std::thread::ThreadId;

use burn::prelude::Backend;

pub use link::{measure_link, Link};
pub(super) use stage::stage;

use crate::run::{self, RunContext};
use slot::{Prefetch, Release};

pub use memsave_common::offload::ActivationOffload;

/// Activation offload's state in one run ([`crate::run::RunContext::part`]): its setting and
/// limit, its figures, and, per training thread, the offloaded segments in forward order and
/// the prefetches held.
#[derive(Default)]
pub(crate) struct RunOffload {
    setting: RwLock<Option<ActivationOffload>>,
    /// The most host bytes offload may hold, with those on their way there.
    host_limit: Mutex<Option<u64>>,
    /// [`stage_on_host_resident_backends`].
    host_as_device: AtomicBool,
    /// [`fail_next_prefetch`].
    injected: Mutex<Option<String>>,
    /// [`slow_copies`].
    copy_delay: Mutex<Option<std::time::Duration>>,
    /// The hooks of this run (a data-parallel peer's each) that hold a setting in force, and
    /// what was in force before the first ([`hold`]).
    held: Mutex<(usize, Option<(Option<ActivationOffload>, Option<u64>)>)>,
    counts: Counts,
    /// Device bytes whose copy to the host is under way.
    in_flight: Mutex<u64>,
    in_flight_changed: Condvar,
    /// The offloaded segments of each training thread, in forward order: backward prefetches
    /// those before the one it reaches.
    order: Mutex<HashMap<ThreadId, Vec<Weak<dyn Prefetch>>>>,
    /// The prefetches each training thread's recomputations took, held until its stream is
    /// past them (`slot::Retained`).
    retaining: Mutex<HashMap<ThreadId, Vec<Box<dyn Release>>>>,
}

/// [`OffloadStats`]' counters.
#[derive(Default)]
struct Counts {
    segments: AtomicU64,
    bytes: AtomicU64,
    prefetched: AtomicU64,
    on_demand: AtomicU64,
    cancelled: AtomicU64,
    host_bytes: AtomicU64,
    host_peak: AtomicU64,
    in_flight_peak: AtomicU64,
    waits: AtomicU64,
}

impl RunOffload {
    fn host_add(&self, bytes: u64) {
        let now = self.counts.host_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.counts.host_peak.fetch_max(now, Ordering::Relaxed);
    }

    fn host_sub(&self, bytes: u64) {
        self.counts.host_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn stats(&self) -> OffloadStats {
        let c = &self.counts;
        OffloadStats {
            segments: c.segments.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            prefetched: c.prefetched.load(Ordering::Relaxed),
            on_demand: c.on_demand.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            host_bytes: c.host_bytes.load(Ordering::Relaxed),
            host_peak: c.host_peak.load(Ordering::Relaxed),
            in_flight_peak: c.in_flight_peak.load(Ordering::Relaxed),
            waits: c.waits.load(Ordering::Relaxed),
        }
    }
}

/// The current run's activation offload state.
fn here() -> Arc<RunOffload> {
    run::current().part::<RunOffload>()
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Switches activation offload on (`Some`) or off (`None`) for the segments checkpointed from
/// now on in the current run ([`crate::run::current`]: its threads, and those it starts);
/// returns the previous setting. The config's `[offload] activations = true` does it for a run.
pub fn set_activation_offload(setting: Option<ActivationOffload>) -> Option<ActivationOffload> {
    let offload = here();
    let mut current = offload
        .setting
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    std::mem::replace(&mut *current, setting)
}

/// The activation offload of the current run, if on.
pub fn activation_offload() -> Option<ActivationOffload> {
    *here()
        .setting
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sets the most host bytes activation offload may hold in the current run (past it, the step
/// that would offload more ends with an error naming the segment); returns the previous limit.
/// A real allocation failure of the host cannot be caught (Rust aborts the process), so the
/// limit is what keeps a run clear of it.
pub fn set_host_limit(limit: Option<u64>) -> Option<u64> {
    std::mem::replace(&mut *lock(&here().host_limit), limit)
}

/// Puts `setting` and `limit` in force in the current run for a hook of it, its figures started
/// again, unless another hook of the run (a data-parallel peer's, on another thread) holds them
/// already (its figures are the run's: they count on): the last [`release`] restores what was
/// there before the first.
pub(crate) fn hold(setting: ActivationOffload, limit: Option<u64>) {
    let offload = here();
    let mut held = lock(&offload.held);
    if held.0 == 0 {
        held.1 = Some((set_activation_offload(Some(setting)), set_host_limit(limit)));
        reset_offload_stats();
    }
    held.0 += 1;
}

/// The end of a [`hold`] in `run` (from any thread: a hook may be dropped where another run is
/// installed, or after its run ended).
pub(crate) fn release(run: &RunContext) {
    let offload = run.part::<RunOffload>();
    let mut held = lock(&offload.held);
    held.0 = held.0.saturating_sub(1);
    if held.0 == 0 {
        if let Some((setting, limit)) = held.1.take() {
            *offload
                .setting
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = setting;
            *lock(&offload.host_limit) = limit;
        }
        *lock(&offload.injected) = None;
        *lock(&offload.copy_delay) = None;
    }
}

/// What CPU staging (either offload) can do on a backend: [`staging`]. (The planner's
/// [`crate::planner::advise::Staging`] is what a plan may spend on it.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StagingSupport {
    /// Its tensors live in memory of the device's own: staging moves them to the host.
    Possible,
    /// Its tensors live in host memory (Flex): host and device are one memory, staging saves
    /// nothing. A run asking for it says so once ([`nothing_to_save`]) and goes on without it.
    NothingToSave,
    /// memsave does not know where its tensors live: why.
    Unknown(String),
}

/// What CPU staging can do on the backend `B` (the inner backend of an autodiff one), in the
/// current run. The one reader of the hidden [`stage_on_host_resident_backends`] switch.
pub fn staging<B: Backend>() -> StagingSupport {
    match crate::nn::host_resident::<B>() {
        Some(false) => StagingSupport::Possible,
        Some(true) if here().host_as_device.load(Ordering::Relaxed) => StagingSupport::Possible,
        Some(true) => StagingSupport::NothingToSave,
        None => StagingSupport::Unknown(format!(
            "memsave does not know where the backend `{}` keeps its tensors (register it with \
             `memsave::nn::register_backend`)",
            std::any::type_name::<B>()
        )),
    }
}

/// The notice a run gives once where `key` (`offload.activations`, `offload.optimizer`) is on
/// but the backend `B` has nothing to offload to ([`StagingSupport::NothingToSave`]).
pub fn nothing_to_save<B: Backend>(key: &str) -> String {
    format!(
        "`{key}` is on, but this run's device keeps its tensors in host memory (backend `{}`): \
         there is nothing to offload to; the run goes on without it",
        std::any::type_name::<B>()
    )
}

/// Whether activation offload can save anything on the backend `B` (the inner backend of an
/// autodiff one): `Err` says why not (its tensors live in host memory, or memsave does not know
/// the backend).
pub fn can_offload<B: Backend>() -> Result<(), String> {
    match staging::<B>() {
        StagingSupport::Possible => Ok(()),
        StagingSupport::NothingToSave => Err(format!(
            "the backend `{}` keeps its tensors in host memory: host and device are one memory, \
             and offloading to the host saves nothing",
            std::any::type_name::<B>()
        )),
        StagingSupport::Unknown(why) => Err(why),
    }
}

/// Lets CPU staging run, in the current run, on a backend whose tensors are host memory (Flex)
/// as on a device with memory of its own: the same copies, threads, limits and steps on the
/// host, nothing saved. For tests of what staging does where no device is (memsave's own CPU
/// tests, data-parallel peers on the CPU); returns the previous setting.
#[doc(hidden)]
pub fn stage_on_host_resident_backends(on: bool) -> bool {
    here().host_as_device.swap(on, Ordering::Relaxed)
}

/// Makes the next copy back to the device of the current run (a prefetch thread's, or the
/// recomputation's own where it comes first) fail with `why`, as on a device lost during it;
/// `None` disarms it. For tests of what a run does then.
#[doc(hidden)]
pub fn fail_next_prefetch(why: Option<String>) {
    *lock(&here().injected) = why;
}

/// Makes each copy to the host of the current run wait `delay` before it starts (`None`: no
/// wait), as on a slow link. For tests that the bound on bytes in flight acts: with copies
/// slower than the forward, they pile up without it.
#[doc(hidden)]
pub fn slow_copies(delay: Option<std::time::Duration>) {
    *lock(&here().copy_delay) = delay;
}

/// What activation offload did in a run since [`reset_offload_stats`] (for logs, tests and the
/// bench).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Segments whose input went to the host.
    pub segments: u64,
    /// Bytes copied to the host.
    pub bytes: u64,
    /// Segments whose input a prefetch had brought back (or was bringing back) when their
    /// recomputation asked.
    pub prefetched: u64,
    /// Segments whose input was copied back only when their recomputation asked.
    pub on_demand: u64,
    /// Segments whose copy to the host had not started when backward reached them (their
    /// device copy was used).
    pub cancelled: u64,
    /// Host bytes held now by offloaded inputs.
    pub host_bytes: u64,
    /// The most host bytes held at once.
    pub host_peak: u64,
    /// The most device bytes whose copy to the host was under way at once (bounded by
    /// [`ActivationOffload::max_in_flight`], or one segment's inputs where those are larger).
    pub in_flight_peak: u64,
    /// Times the forward waited for copies to make room under `max_in_flight`.
    pub waits: u64,
}

impl OffloadStats {
    /// What offload did in `run` since the last reset there.
    pub fn of(run: &RunContext) -> Self {
        run.part::<RunOffload>().stats()
    }
}

/// What offload did in the current run since the last reset.
pub fn offload_stats() -> OffloadStats {
    here().stats()
}

/// Starts the counts of [`offload_stats`] of the current run again (the host peak at the bytes
/// held now).
pub fn reset_offload_stats() {
    let offload = here();
    let c = &offload.counts;
    for counter in [
        &c.segments,
        &c.bytes,
        &c.prefetched,
        &c.on_demand,
        &c.cancelled,
        &c.in_flight_peak,
        &c.waits,
    ] {
        counter.store(0, Ordering::Relaxed);
    }
    c.host_peak
        .store(c.host_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Waits until every copy to the host the current run started so far is done (their device
/// copies dropped): what a measurement of the memory kept after a forward reads after.
pub fn wait_for_copies() {
    let offload = here();
    let mut in_flight = lock(&offload.in_flight);
    while *in_flight > 0 {
        in_flight = offload
            .in_flight_changed
            .wait(in_flight)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
}

/// Lets go the prefetched inputs this training thread's recomputations took, once its stream
/// is past them (`sync`; without it, after a failed step, at once). Called on the training
/// stream: by a recomputation before it takes its inputs, and when the step's helpers are
/// joined ([`super::join_helpers`]).
pub(crate) fn release_retained(sync: bool) {
    here().release_retained(sync);
}

/// After a step of this training thread ended early (a failure, or a panic): its offloaded
/// segments are let go (their host bytes leave the count, and a later step neither prefetches
/// nor numbers them). Burn frees the abandoned graph itself only at the next backward pass.
pub(crate) fn abandon() {
    release_retained(false);
    let slots = lock(&here().order)
        .remove(&run::owner())
        .unwrap_or_default();
    for slot in slots.iter().filter_map(Weak::upgrade) {
        slot.abandon();
    }
}
