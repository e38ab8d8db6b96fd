//! One segment's offloaded inputs (a [`Slot`]): where they are (device, on their way to the
//! host, host, on their way back, back), the copier and the prefetch that move them, and the
//! prefetches held until the training stream is past them ([`Retained`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};

use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorData;

use super::{lock, RunOffload};
use crate::checkpoint::threads;
use crate::run;

/// Where a segment's offloaded inputs are.
pub(super) enum State<B: Backend> {
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
pub(super) struct Slot<B: Backend> {
    pub(super) state: Mutex<State<B>>,
    pub(super) changed: Condvar,
    pub(super) device: B::Device,
    /// `` `Type::method` `` and its place in the forward, for messages.
    pub(super) name: String,
    pub(super) bytes: u64,
    /// The run it belongs to: its counts, limit and bytes in flight.
    pub(super) run: Arc<RunOffload>,
}

/// A segment whose inputs can be brought back ahead of its recomputation.
pub(crate) trait Prefetch: Send + Sync {
    /// Starts bringing the inputs back, if they are on the host.
    fn prefetch(self: Arc<Self>);
    /// See [`Slot::abandon`].
    fn abandon(&self);
}

impl<B: Backend> Slot<B> {
    /// The copier: reads the inputs into host memory, then drops their device copies. Their
    /// bytes leave the count in flight as they join the host's, in one step (the host limit
    /// reads both).
    pub(super) fn download(&self) {
        let delay = *lock(&self.run.copy_delay);
        if let Some(delay) = delay {
            std::thread::sleep(delay);
        }
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
        // A thread boundary: the device's read may panic (a lost device); the copy then fails
        // and the recomputation that asks for it reports the failure as the step's error.
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
        let mut in_flight = lock(&self.run.in_flight);
        if let Some(next) = next {
            let mut state = lock(&self.state);
            if matches!(*state, State::Copying) {
                if matches!(next, State::Host(_)) {
                    self.run.host_add(self.bytes);
                }
                *state = next;
            }
        }
        *in_flight -= self.bytes;
        drop(in_flight);
        self.run.in_flight_changed.notify_all();
    }

    /// The step this segment belongs to ended early (a failure or a panic): its inputs,
    /// wherever they are, are let go, and their host bytes leave the count.
    fn abandon(&self) {
        let mut state = lock(&self.state);
        if matches!(*state, State::Host(_)) {
            self.run.host_sub(self.bytes);
        }
        // A copy under way finds this when it ends, and drops what it copied.
        *state = State::Failed("the step it belonged to was abandoned".to_string());
        drop(state);
        self.changed.notify_all();
    }

    /// Copies `datas` back to the device (on the calling thread).
    fn upload(&self, datas: Vec<TensorData>) -> State<B> {
        // A device that cannot take the copy (lost, reset) panics inside Burn: caught here, the
        // one place a copy back meets the device, and made the segment's failure.
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            datas
                .into_iter()
                .map(|data| B::float_from_data(data, &self.device))
                .collect::<Vec<_>>()
        }));
        self.run.host_sub(self.bytes);
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
        let next = match lock(&self.run.injected).take() {
            Some(why) => {
                drop(datas);
                self.run.host_sub(self.bytes);
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
    pub(super) fn take(&self) -> Result<Vec<FloatTensor<B>>, String> {
        self.run.release_retained(true);
        let counts = &self.run.counts;
        let mut state = lock(&self.state);
        loop {
            match std::mem::replace(&mut *state, State::Taken) {
                State::Device(prims) => {
                    counts.cancelled.fetch_add(1, Ordering::Relaxed);
                    return Ok(prims);
                }
                State::Ready(prims) => {
                    counts.prefetched.fetch_add(1, Ordering::Relaxed);
                    self.run.retain(Box::new(Retained::<B> {
                        device: self.device.clone(),
                        prims: prims.clone(),
                    }));
                    return Ok(prims);
                }
                State::Host(datas) => {
                    drop(state);
                    counts.on_demand.fetch_add(1, Ordering::Relaxed);
                    // An injected loss is the next copy back's, whoever makes it: where the
                    // recomputation comes before its prefetch thread ran, its own.
                    if let Some(why) = lock(&self.run.injected).take() {
                        drop(datas);
                        self.run.host_sub(self.bytes);
                        return Err(format!("the copy back to the device failed: {why}"));
                    }
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
        let work = run::inherit().wrap(threads::on_copy_stream(move || slot.load()));
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
            self.run.host_sub(self.bytes);
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

pub(crate) trait Release: Send {
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

impl RunOffload {
    /// Holds `retained` for the calling training thread.
    fn retain(&self, retained: Box<dyn Release>) {
        lock(&self.retaining)
            .entry(run::owner())
            .or_default()
            .push(retained);
    }

    /// See [`super::release_retained`].
    pub(super) fn release_retained(&self, sync: bool) {
        let held = lock(&self.retaining)
            .remove(&run::owner())
            .unwrap_or_default();
        let mut sync = sync;
        for retained in held {
            retained.release(sync);
            // One wait covers them all.
            sync = false;
        }
    }
}
