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
//! Failures end the step, not the process's sense of it: past the host limit
//! ([`set_host_limit`], the runner's `[memory] host_budget`) the forward stops before it
//! offloads, and a copy back that fails (a device lost during a prefetch) stops the backward;
//! each names the segment (its type, method and place in the forward) and is recorded for the
//! runner, which ends the run with an error that says what to change.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock, Weak};
use std::thread::ThreadId;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, TensorData, TensorMetadata};

use super::segment::Segment;
use super::threads;

/// How activation offload runs (see the module docs); on while set with
/// [`set_activation_offload`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationOffload {
    /// Tensors smaller than this stay on the device (torchtune's `min_offload_size`, 1 KiB).
    pub min_bytes: u64,
    /// The most device bytes whose copy to the host is under way (their device copies still
    /// held); past it the forward waits for the copies.
    pub max_in_flight: u64,
    /// How many segments backward brings back ahead of the one it recomputes (0: each when its
    /// recomputation asks). Transformer Engine's advice for full overlap: two.
    pub prefetch: usize,
}

impl Default for ActivationOffload {
    fn default() -> Self {
        ActivationOffload {
            min_bytes: 1024,
            max_in_flight: 256 << 20,
            prefetch: 2,
        }
    }
}

static SETTING: RwLock<Option<ActivationOffload>> = RwLock::new(None);

/// Switches activation offload on (`Some`) or off (`None`) for the segments checkpointed from
/// now on, in every thread of the process; returns the previous setting. The config's
/// `[offload] activations = true` does it for a run.
pub fn set_activation_offload(setting: Option<ActivationOffload>) -> Option<ActivationOffload> {
    let mut current = SETTING.write().unwrap_or_else(|e| e.into_inner());
    std::mem::replace(&mut *current, setting)
}

/// The activation offload in force, if on.
pub fn activation_offload() -> Option<ActivationOffload> {
    *SETTING.read().unwrap_or_else(|e| e.into_inner())
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

/// What CPU staging can do on the backend `B` (the inner backend of an autodiff one). The one
/// reader of the hidden [`stage_on_host_resident_backends`] switch.
pub fn staging<B: Backend>() -> StagingSupport {
    match crate::nn::host_resident::<B>() {
        Some(false) => StagingSupport::Possible,
        Some(true) if HOST_AS_DEVICE.load(Ordering::Relaxed) => StagingSupport::Possible,
        Some(true) => StagingSupport::NothingToSave,
        None => StagingSupport::Unknown(format!(
            "memsave does not know where the backend `{}` keeps its tensors (register it with \
             `memsave::nn::register_backend`)",
            std::any::type_name::<B>()
        )),
    }
}

/// The line a run prints once where `key` (`offload.activations`, `offload.optimizer`) is on
/// but the backend `B` has nothing to offload to ([`StagingSupport::NothingToSave`]).
pub fn nothing_to_save<B: Backend>(key: &str) -> String {
    format!(
        "memsave: `{key}` is on, but this run's device keeps its tensors in host memory \
         (backend `{}`): there is nothing to offload to; the run goes on without it",
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

static HOST_AS_DEVICE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets CPU staging run on a backend whose tensors are host memory (Flex) as on a device with
/// memory of its own: the same copies and the same steps on the host, nothing saved. For tests
/// of what staging computes where no device is (data-parallel peers on the CPU); returns the
/// previous setting.
#[doc(hidden)]
pub fn stage_on_host_resident_backends(on: bool) -> bool {
    HOST_AS_DEVICE.swap(on, Ordering::Relaxed)
}

/// The link between a device and host memory, bytes a second each way, measured by
/// [`measure_link`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Host to device.
    pub up: f64,
    /// Device to host.
    pub down: f64,
}

impl Link {
    /// The slower way: what a copy there and back is priced at.
    pub fn slower(&self) -> f64 {
        self.up.min(self.down)
    }
}

/// Measures the link between `device` and host memory: `bytes` of f32 copied up and read back,
/// the best of three (after a small copy each way, which readies the runtime's pools). `None`
/// where the backend's tensors are host memory (there is no link) or the device fails. On
/// Mesa's lavapipe, whose "device" memory is host memory, this is a memory copy through
/// Vulkan's staging buffers, not a bus.
pub fn measure_link<B: Backend>(device: &B::Device, bytes: usize) -> Option<Link> {
    use burn::tensor::Tensor;
    use std::time::Instant;
    if crate::nn::host_resident::<B>() != Some(false) {
        return None;
    }
    let elements = (bytes / 4).max(1);
    let once = |elements: usize| -> Option<(f64, f64)> {
        let data = TensorData::new(vec![1.0f32; elements], [elements]);
        let started = Instant::now();
        let tensor = Tensor::<B, 1>::from_data(data, device);
        B::sync(device).ok()?;
        let up = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let back = tensor.into_data();
        let down = started.elapsed().as_secs_f64();
        (back.num_elements() == elements).then_some((up, down))
    };
    once(1024)?;
    let mut best = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        let (up, down) = once(elements)?;
        best = (best.0.min(up), best.1.min(down));
    }
    let moved = (elements * 4) as f64;
    Some(Link {
        up: moved / best.0.max(1e-9),
        down: moved / best.1.max(1e-9),
    })
}

/// What activation offload did since [`reset_offload_stats`] (for logs, tests and the bench).
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

static SEGMENTS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
static PREFETCHED: AtomicU64 = AtomicU64::new(0);
static ON_DEMAND: AtomicU64 = AtomicU64::new(0);
static CANCELLED: AtomicU64 = AtomicU64::new(0);
static HOST_BYTES: AtomicU64 = AtomicU64::new(0);
static HOST_PEAK: AtomicU64 = AtomicU64::new(0);
static IN_FLIGHT_PEAK: AtomicU64 = AtomicU64::new(0);
static WAITS: AtomicU64 = AtomicU64::new(0);

/// What offload did since the last reset.
pub fn offload_stats() -> OffloadStats {
    OffloadStats {
        segments: SEGMENTS.load(Ordering::Relaxed),
        bytes: BYTES.load(Ordering::Relaxed),
        prefetched: PREFETCHED.load(Ordering::Relaxed),
        on_demand: ON_DEMAND.load(Ordering::Relaxed),
        cancelled: CANCELLED.load(Ordering::Relaxed),
        host_bytes: HOST_BYTES.load(Ordering::Relaxed),
        host_peak: HOST_PEAK.load(Ordering::Relaxed),
        in_flight_peak: IN_FLIGHT_PEAK.load(Ordering::Relaxed),
        waits: WAITS.load(Ordering::Relaxed),
    }
}

/// Starts the counts of [`offload_stats`] again (the host peak at the bytes held now).
pub fn reset_offload_stats() {
    for counter in [
        &SEGMENTS,
        &BYTES,
        &PREFETCHED,
        &ON_DEMAND,
        &CANCELLED,
        &IN_FLIGHT_PEAK,
        &WAITS,
    ] {
        counter.store(0, Ordering::Relaxed);
    }
    HOST_PEAK.store(HOST_BYTES.load(Ordering::Relaxed), Ordering::Relaxed);
}

fn host_add(bytes: u64) {
    let now = HOST_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
    HOST_PEAK.fetch_max(now, Ordering::Relaxed);
}

fn host_sub(bytes: u64) {
    HOST_BYTES.fetch_sub(bytes, Ordering::Relaxed);
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Where a segment's offloaded inputs are.
enum State<B: Backend> {
    /// On the device, the copy to the host not started.
    Device(Vec<FloatTensor<B>>),
    /// Being copied to the host.
    Copying,
    /// In host memory.
    Host(Vec<TensorData>),
    /// Being copied back.
    Loading,
    /// Back on the device.
    Ready(Vec<FloatTensor<B>>),
    /// Taken by the recomputation.
    Taken,
    /// A copy failed: why.
    Failed(String),
}

/// The offloaded inputs of one checkpointed segment.
struct Slot<B: Backend> {
    state: Mutex<State<B>>,
    changed: Condvar,
    device: B::Device,
    /// `` `Type::method` `` and its place in the forward, for messages.
    name: String,
    bytes: u64,
}

/// A segment whose inputs can be brought back ahead of its recomputation.
trait Prefetch: Send + Sync {
    /// Starts bringing the inputs back, if they are on the host.
    fn prefetch(self: Arc<Self>);
    /// See [`Slot::abandon`].
    fn abandon(&self);
}

impl<B: Backend> Slot<B> {
    /// The copier: reads the inputs into host memory, then drops their device copies. Their
    /// bytes leave the count in flight as they join the host's, in one step (the host limit
    /// reads both).
    fn download(&self) {
        let prims = {
            let mut state = lock(&self.state);
            match std::mem::replace(&mut *state, State::Copying) {
                State::Device(prims) => prims,
                // Backward took them first, or the step was abandoned.
                other => {
                    *state = other;
                    drop(state);
                    self.landed(None);
                    return;
                }
            }
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            prims
                .into_iter()
                .map(
                    |prim| match burn::tensor::try_read_sync(B::float_into_data(prim)) {
                        Some(Ok(data)) => Ok(data),
                        Some(Err(error)) => Err(format!("{error:?}")),
                        None => Err("the device cannot be read synchronously here".to_string()),
                    },
                )
                .collect::<Result<Vec<_>, String>>()
        }));
        let next = match outcome {
            Ok(Ok(datas)) => State::Host(datas),
            Ok(Err(error)) => State::Failed(format!("the copy to the host failed: {error}")),
            Err(payload) => State::Failed(format!(
                "the copy to the host failed: {}",
                crate::panic_text(payload.as_ref()).unwrap_or("(no message)")
            )),
        };
        self.landed(Some(next));
        self.changed.notify_all();
    }

    /// A copy to the host ended with `next` (`None`: it did not start): the bytes leave those
    /// in flight, and join the host's where `next` holds them, unless the step was abandoned
    /// meanwhile (then `next` is dropped).
    fn landed(&self, next: Option<State<B>>) {
        let mut in_flight = lock(&IN_FLIGHT);
        if let Some(next) = next {
            let mut state = lock(&self.state);
            if matches!(*state, State::Copying) {
                if matches!(next, State::Host(_)) {
                    host_add(self.bytes);
                }
                *state = next;
            }
        }
        *in_flight -= self.bytes;
        drop(in_flight);
        IN_FLIGHT_CHANGED.notify_all();
    }

    /// The step this segment belongs to was abandoned (a panic ended it): its inputs, wherever
    /// they are, are let go, and their host bytes leave the count.
    fn abandon(&self) {
        let mut state = lock(&self.state);
        if matches!(*state, State::Host(_)) {
            host_sub(self.bytes);
        }
        // A copy under way finds this when it ends, and drops what it copied.
        *state = State::Failed("the step it belonged to was abandoned".to_string());
        drop(state);
        self.changed.notify_all();
    }

    /// Copies `datas` back to the device (on the calling thread).
    fn upload(&self, datas: Vec<TensorData>) -> State<B> {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            datas
                .into_iter()
                .map(|data| B::float_from_data(data, &self.device))
                .collect::<Vec<_>>()
        }));
        host_sub(self.bytes);
        match outcome {
            Ok(prims) => State::Ready(prims),
            Err(payload) => State::Failed(format!(
                "the copy back to the device failed: {}",
                crate::panic_text(payload.as_ref()).unwrap_or("(no message)")
            )),
        }
    }

    /// A helper's prefetch: the inputs back to the device, if they are still on the host.
    fn load(&self) {
        let datas = {
            let mut state = lock(&self.state);
            match std::mem::replace(&mut *state, State::Loading) {
                State::Host(datas) => datas,
                other => {
                    *state = other;
                    return;
                }
            }
        };
        let next = match lock(&INJECTED).take() {
            Some(why) => {
                drop(datas);
                host_sub(self.bytes);
                State::Failed(format!("the copy back to the device failed: {why}"))
            }
            None => self.upload(datas),
        };
        let mut state = lock(&self.state);
        if matches!(*state, State::Loading) {
            *state = next;
        }
        drop(state);
        self.changed.notify_all();
    }

    /// The inputs, back on the device, for the recomputation: waits for a copy under way.
    fn take(&self) -> Result<Vec<FloatTensor<B>>, String> {
        release_retained(true);
        let mut state = lock(&self.state);
        loop {
            match std::mem::replace(&mut *state, State::Taken) {
                State::Device(prims) => {
                    CANCELLED.fetch_add(1, Ordering::Relaxed);
                    return Ok(prims);
                }
                State::Ready(prims) => {
                    PREFETCHED.fetch_add(1, Ordering::Relaxed);
                    retain(Retained::<B> {
                        device: self.device.clone(),
                        prims: prims.clone(),
                    });
                    return Ok(prims);
                }
                State::Host(datas) => {
                    drop(state);
                    ON_DEMAND.fetch_add(1, Ordering::Relaxed);
                    return match self.upload(datas) {
                        State::Ready(prims) => Ok(prims),
                        State::Failed(error) => Err(error),
                        _ => unreachable!("an upload ends ready or failed"),
                    };
                }
                waiting @ (State::Copying | State::Loading) => {
                    *state = waiting;
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
                State::Failed(error) => {
                    *state = State::Failed(error.clone());
                    return Err(error);
                }
                State::Taken => return Err("its inputs were taken twice".to_string()),
            }
        }
    }
}

impl<B: Backend> Prefetch for Slot<B> {
    fn prefetch(self: Arc<Self>) {
        if !matches!(&*lock(&self.state), State::Host(_)) {
            return;
        }
        let slot = self.clone();
        let work = threads::on_copy_stream(move || slot.load());
        // Where no thread can start, the recomputation copies back itself.
        let _ = std::thread::Builder::new()
            .name("memsave-prefetch".into())
            .spawn(work);
    }

    fn abandon(&self) {
        Slot::abandon(self);
    }
}

impl<B: Backend> Drop for Slot<B> {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if matches!(state, State::Host(_)) {
            host_sub(self.bytes);
        }
    }
}

/// Prefetched inputs a recomputation has taken, held until the training stream is past them.
///
/// A prefetch makes its buffers on the copy stream, from that stream's pool, and the
/// recomputation reads them on the training stream. When the recomputation drops them, they go
/// back to the copy stream's pool at once, while the training stream's kernels that read them
/// may still be queued: the next prefetch could take such a buffer and overwrite it first
/// (wgpu's streams share one queue, in the order they are flushed; CUDA's run side by side).
/// So each taken prefetch is held here until the next recomputation of the thread takes its
/// inputs (or the step's helpers are joined), which waits for the training stream first: one
/// segment's inputs at most stay on the device a little longer (and, held twice, are not
/// overwritten in place by the recomputation's first operation).
struct Retained<B: Backend> {
    device: B::Device,
    prims: Vec<FloatTensor<B>>,
}

trait Release: Send {
    /// Waits for the training stream (where `sync`), then lets the buffers go.
    fn release(self: Box<Self>, sync: bool);
}

impl<B: Backend> Release for Retained<B> {
    fn release(self: Box<Self>, sync: bool) {
        if sync {
            // A device that cannot sync has failed the step already: the step's error says so.
            let _ = B::sync(&self.device);
        }
        drop(self.prims);
    }
}

type Retaining = Mutex<HashMap<ThreadId, Vec<Box<dyn Release>>>>;

fn retaining() -> &'static Retaining {
    static RETAINING: OnceLock<Retaining> = OnceLock::new();
    RETAINING.get_or_init(|| Mutex::new(HashMap::new()))
}

fn retain<B: Backend>(retained: Retained<B>) {
    lock(retaining())
        .entry(threads::owner())
        .or_default()
        .push(Box::new(retained));
}

/// Lets go the prefetched inputs this training thread's recomputations took, once its stream
/// is past them (`sync`; without it, after a failed step, at once). Called on the training
/// stream: by a recomputation before it takes its inputs, and when the step's helpers are
/// joined ([`super::join_helpers`]).
pub(crate) fn release_retained(sync: bool) {
    let held = lock(retaining())
        .remove(&threads::owner())
        .unwrap_or_default();
    let mut sync = sync;
    for retained in held {
        retained.release(sync);
        // One wait covers them all.
        sync = false;
    }
}

/// The offloaded segments of each training thread (a data-parallel peer is one), in forward
/// order: backward prefetches those before the one it reaches.
type Order = Mutex<HashMap<ThreadId, Vec<Weak<dyn Prefetch>>>>;

fn order() -> &'static Order {
    static ORDER: OnceLock<Order> = OnceLock::new();
    ORDER.get_or_init(|| Mutex::new(HashMap::new()))
}

fn register(slot: Arc<dyn Prefetch>) {
    let mut order = lock(order());
    let list = order.entry(threads::owner()).or_default();
    list.retain(|weak| weak.strong_count() > 0);
    list.push(Arc::downgrade(&slot));
}

/// The place the next offloaded segment of this thread's forward takes in it (1: the first),
/// for messages: segments of one type are told apart by it.
fn next_place() -> usize {
    let mut order = lock(order());
    let list = order.entry(threads::owner()).or_default();
    list.retain(|weak| weak.strong_count() > 0);
    list.len() + 1
}

/// Drops `slot` from its thread's order and prefetches the `count` live segments before it.
fn prefetch_before(slot: *const (), count: usize) {
    let ahead: Vec<Arc<dyn Prefetch>> = {
        let mut order = lock(order());
        let Some(list) = order.get_mut(&threads::owner()) else {
            return;
        };
        list.retain(|weak| weak.strong_count() > 0);
        let Some(at) = list
            .iter()
            .position(|weak| Weak::as_ptr(weak) as *const () == slot)
        else {
            return;
        };
        list.remove(at);
        list[..at]
            .iter()
            .rev()
            .filter_map(Weak::upgrade)
            .take(count)
            .collect()
    };
    for slot in ahead {
        slot.prefetch();
    }
}

/// Device bytes whose copy to the host is under way.
static IN_FLIGHT: Mutex<u64> = Mutex::new(0);
static IN_FLIGHT_CHANGED: Condvar = Condvar::new();

/// Why activation offload ended a step: recorded before the panic that unwinds the step, for the
/// runner to turn into its error ([`take_failure`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The host could not take a segment's input within its limit ([`set_host_limit`]).
    HostFull {
        /// The checkpointed segment: `` `Type::method` `` and its place in the forward.
        segment: String,
        /// Its offloaded bytes.
        needed: u64,
        /// Bytes activation offload held or was copying to the host then.
        held: u64,
        /// The limit.
        limit: u64,
    },
    /// A copy between host and device failed (a device lost, a driver reset).
    Copy {
        /// The checkpointed segment: `` `Type::method` `` and its place in the forward.
        segment: String,
        /// What the copy said.
        why: String,
    },
}

/// The failure of each training thread (a data-parallel peer is one), until its runner takes it.
fn failures() -> &'static Mutex<HashMap<ThreadId, Failure>> {
    static FAILURES: OnceLock<Mutex<HashMap<ThreadId, Failure>>> = OnceLock::new();
    FAILURES.get_or_init(|| Mutex::new(HashMap::new()))
}

fn record(failure: Failure) {
    lock(failures()).insert(threads::owner(), failure);
}

/// Whether `message` is one of activation offload's failures, which are recorded for the runner
/// ([`take_failure`]).
pub(crate) fn is_recorded(message: &str) -> bool {
    message.starts_with(SAYS)
}

/// The failure that ended this training thread's step, if activation offload's.
pub(crate) fn take_failure() -> Option<Failure> {
    lock(failures()).remove(&threads::owner())
}

/// The most host bytes activation offload may hold (with those being copied there); `None`:
/// no limit. The runner sets it from `[memory] host_budget` ([`crate::hooks::OffloadHook`]).
static HOST_LIMIT: Mutex<Option<u64>> = Mutex::new(None);

/// Sets the most host bytes activation offload may hold, in every thread of the process (past
/// it, the step that would offload more ends with an error naming the segment); returns the
/// previous limit. A real allocation failure of the host cannot be caught (Rust aborts the
/// process), so the limit is what keeps a run clear of it.
pub fn set_host_limit(limit: Option<u64>) -> Option<u64> {
    std::mem::replace(&mut *lock(&HOST_LIMIT), limit)
}

/// A prefetch that fails as on a lost device, once (the device suite's stand-in for a driver
/// reset during a prefetch).
static INJECTED: Mutex<Option<String>> = Mutex::new(None);

/// Makes the next prefetch (a helper thread's copy of an offloaded input back to the device)
/// fail with `why`, as on a device lost during it; `None` disarms it. For tests of what a run
/// does then.
#[doc(hidden)]
pub fn fail_next_prefetch(why: Option<String>) {
    *lock(&INJECTED) = why;
}

/// After a panic ended a step of this training thread: its offloaded segments are let go (their
/// host bytes leave the count, and a later step neither prefetches nor numbers them). Burn
/// frees the abandoned graph itself only at the next backward pass.
pub(crate) fn abandon() {
    release_retained(false);
    let slots = lock(order()).remove(&threads::owner()).unwrap_or_default();
    for slot in slots.iter().filter_map(Weak::upgrade) {
        slot.abandon();
    }
}

/// Waits until every copy to the host started so far is done (their device copies dropped):
/// what a measurement of the memory kept after a forward reads after.
pub fn wait_for_copies() {
    let mut in_flight = lock(&IN_FLIGHT);
    while *in_flight > 0 {
        in_flight = IN_FLIGHT_CHANGED
            .wait(in_flight)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
}

/// The offloaded inputs of one segment, held by its anchor until its recomputation.
pub(super) struct Staged<B: Backend> {
    slot: Arc<Slot<B>>,
    /// The positions (in [`Segment::map_floats`]' order) of the inputs offloaded.
    picked: Vec<usize>,
    prefetch: usize,
}

/// The segment `name`'s `input` with its large float tensors offloaded, where activation offload
/// is on and can save something on `B`; else `input` as it is.
pub(super) fn stage<B, C, I>(input: I, name: impl FnOnce() -> String) -> (I, Option<Staged<B>>)
where
    B: Backend,
    C: CheckpointStrategy,
    I: Segment<Autodiff<B, C>>,
{
    let Some(setting) = activation_offload() else {
        return (input, None);
    };
    if super::context::is_recomputing() {
        return (input, None);
    }
    if let Err(why) = can_offload::<B>() {
        say_once(&why);
        return (input, None);
    }
    let mut picked = Vec::new();
    let mut prims = Vec::new();
    let mut bytes = 0u64;
    let mut device = None;
    let mut index = 0;
    let input = input.map_floats(&mut |mut tensor| {
        let size =
            (tensor.primitive.shape().num_elements() * tensor.primitive.dtype().size()) as u64;
        if size >= setting.min_bytes.max(1) {
            let here = B::float_device(&tensor.primitive);
            let stand_in = B::float_zeros([1].into(), &here, FloatDType::F32);
            prims.push(std::mem::replace(&mut tensor.primitive, stand_in));
            device.get_or_insert(here);
            picked.push(index);
            bytes += size;
        }
        index += 1;
        tensor
    });
    let Some(device) = device else {
        return (input, None);
    };
    let name = format!(
        "`{}` (the forward's offloaded segment {})",
        name(),
        next_place()
    );
    // The host limit (the bytes held and those on their way there), then the bound on bytes in
    // flight (waiting while others' copies fill it), then the bytes reserved: under one lock.
    let mut in_flight = lock(&IN_FLIGHT);
    if let Some(limit) = *lock(&HOST_LIMIT) {
        let held = HOST_BYTES.load(Ordering::Relaxed) + *in_flight;
        if held + bytes > limit {
            drop(in_flight);
            record(Failure::HostFull {
                segment: name.clone(),
                needed: bytes,
                held,
                limit,
            });
            drop(prims);
            // Unwound without the panic hook's report: the runner says it, as an error.
            std::panic::resume_unwind(Box::new(format!(
                "{SAYS}the host cannot take the input of the checkpointed segment {name} \
                 ({bytes} bytes): offload holds {held} bytes there, of at most {limit}"
            )));
        }
    }
    if *in_flight > 0 && *in_flight + bytes > setting.max_in_flight {
        WAITS.fetch_add(1, Ordering::Relaxed);
    }
    while *in_flight > 0 && *in_flight + bytes > setting.max_in_flight {
        in_flight = IN_FLIGHT_CHANGED
            .wait(in_flight)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
    *in_flight += bytes;
    IN_FLIGHT_PEAK.fetch_max(*in_flight, Ordering::Relaxed);
    drop(in_flight);
    let slot = Arc::new(Slot {
        state: Mutex::new(State::Device(prims)),
        changed: Condvar::new(),
        device,
        name,
        bytes,
    });
    SEGMENTS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(bytes, Ordering::Relaxed);
    register(slot.clone());

    let copier = slot.clone();
    let work = threads::on_copy_stream(move || copier.download());
    if let Err(work) = spawn_or_return(work) {
        // No thread: copy here.
        work();
    }
    (
        input,
        Some(Staged {
            slot,
            picked,
            prefetch: setting.prefetch,
        }),
    )
}

/// Starts `work` on a thread of its own, or hands it back where none can start.
fn spawn_or_return<W: FnOnce() + Send + 'static>(work: W) -> Result<(), W> {
    let work = Arc::new(Mutex::new(Some(work)));
    let run = work.clone();
    let started = std::thread::Builder::new()
        .name("memsave-offload".into())
        .spawn(move || {
            if let Some(work) = lock(&run).take() {
                work();
            }
        });
    match started {
        Ok(_) => Ok(()),
        Err(_) => Err(lock(&work).take().expect("the thread never started")),
    }
}

impl<B: Backend> Staged<B> {
    /// `input` with its offloaded tensors back on the device; starts the prefetch of the
    /// segments before this one.
    pub(super) fn restore<C, I>(self, input: I) -> Result<I, String>
    where
        C: CheckpointStrategy,
        I: Segment<Autodiff<B, C>>,
    {
        let taken = self.slot.take().map_err(|why| {
            record(Failure::Copy {
                segment: self.slot.name.clone(),
                why: why.clone(),
            });
            format!(
                "{SAYS}the input of the checkpointed segment {} could not be brought back to \
                 the device for its recomputation: {why}",
                self.slot.name
            )
        })?;
        prefetch_before(Arc::as_ptr(&self.slot) as *const (), self.prefetch);
        let mut values = taken.into_iter();
        let mut picked = self.picked.iter().peekable();
        let mut index = 0;
        Ok(input.map_floats(&mut |mut tensor| {
            if picked.peek() == Some(&&index) {
                picked.next();
                if let Some(value) = values.next() {
                    tensor.primitive = value;
                }
            }
            index += 1;
            tensor
        }))
    }
}

/// How offload's messages start.
const SAYS: &str = "memsave: activation offload: ";

/// Says `why` on stderr, once per process.
fn say_once(why: &str) {
    static SAID: Mutex<bool> = Mutex::new(false);
    let mut said = lock(&SAID);
    if !*said {
        eprintln!("memsave: activation offload is off: {why}");
        *said = true;
    }
}
