//! The forward's side of activation offload ([`stage`]: a segment's large inputs handed to a
//! copier) and backward's ([`Staged::restore`]: taken back, the segments before prefetched).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::prelude::Backend;
use burn::tensor::{FloatDType, TensorMetadata};

use super::slot::{Prefetch, Slot, State};
use super::{activation_offload, can_offload, here, lock, RunOffload};
use crate::checkpoint::segment::Segment;
use crate::checkpoint::threads;
use crate::{run, Error};

/// The offloaded inputs of one segment, held by its anchor until its recomputation.
pub(in crate::checkpoint) struct Staged<B: Backend> {
    slot: Arc<Slot<B>>,
    /// The positions (in [`Segment::map_floats`]' order) of the inputs offloaded.
    picked: Vec<usize>,
    prefetch: usize,
}

/// The segment `name`'s `input` with its large float tensors offloaded, where activation offload
/// is on in the current run and can save something on `B`; else `input` as it is. Past the
/// run's host limit the input stays on the device and the step's failure is recorded
/// ([`crate::run`]): the forward goes on, and whoever drives the step ends it with the error.
pub(in crate::checkpoint) fn stage<B, C, I>(
    input: I,
    forced: bool,
    name: impl FnOnce() -> String,
) -> (I, Option<Staged<B>>)
where
    B: Backend,
    C: CheckpointStrategy,
    I: Segment<Autodiff<B, C>>,
{
    // A segment `"dynamic"` chose to offload (`forced`) stages with the defaults where the run
    // has no setting of its own.
    let Some(setting) = activation_offload().or(forced.then(Default::default)) else {
        return (input, None);
    };
    if crate::checkpoint::context::is_recomputing() || run::has_failed() {
        return (input, None);
    }
    if let Err(why) = can_offload::<B>() {
        if run::current().first_time("activation offload is off") {
            tracing::warn!(target: "memsave", reason = %why, "activation offload is off: {why}");
        }
        return (input, None);
    }
    let min_bytes = setting.min_bytes.max(1);
    let size = |tensor: &burn::tensor::ops::FloatTensor<Autodiff<B, C>>| {
        (tensor.primitive.shape().num_elements() * tensor.primitive.dtype().size()) as u64
    };
    let sizes: Vec<u64> = crate::checkpoint::floats(&input).iter().map(size).collect();
    let bytes: u64 = sizes.iter().filter(|&&size| size >= min_bytes).sum();
    if bytes == 0 {
        return (input, None);
    }
    let offload = here();
    let name = format!(
        "`{}` (the forward's offloaded segment {})",
        name(),
        offload.next_place()
    );
    // The host limit (the bytes held and those on their way there), then the bound on bytes in
    // flight (waiting while others' copies fill it), then the bytes reserved: under one lock.
    let mut in_flight = lock(&offload.in_flight);
    if let Some(limit) = *lock(&offload.host_limit) {
        let held = offload.counts.host_bytes.load(Ordering::Relaxed) + *in_flight;
        if held + bytes > limit {
            drop(in_flight);
            run::fail(host_full(&name, bytes, held, limit));
            return (input, None);
        }
    }
    if *in_flight > 0 && *in_flight + bytes > setting.max_in_flight {
        offload.counts.waits.fetch_add(1, Ordering::Relaxed);
    }
    while *in_flight > 0 && *in_flight + bytes > setting.max_in_flight {
        in_flight = offload
            .in_flight_changed
            .wait(in_flight)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
    *in_flight += bytes;
    offload
        .counts
        .in_flight_peak
        .fetch_max(*in_flight, Ordering::Relaxed);
    drop(in_flight);

    let mut picked = Vec::new();
    let mut prims = Vec::new();
    let mut device = None;
    let mut index = 0;
    let input = input.map_floats(&mut |mut tensor| {
        if sizes[index] >= min_bytes {
            let here = B::float_device(&tensor.primitive);
            let stand_in = B::float_zeros([1].into(), &here, FloatDType::F32);
            prims.push(std::mem::replace(&mut tensor.primitive, stand_in));
            device.get_or_insert(here);
            picked.push(index);
        }
        index += 1;
        tensor
    });
    let device = device.expect("a tensor of at least min_bytes was picked");
    let slot = Arc::new(Slot {
        state: Mutex::new(State::Device(prims)),
        changed: Condvar::new(),
        device,
        name,
        bytes,
        run: offload.clone(),
    });
    offload.counts.segments.fetch_add(1, Ordering::Relaxed);
    offload.counts.bytes.fetch_add(bytes, Ordering::Relaxed);
    offload.register(slot.clone());

    let copier = slot.clone();
    let work = run::inherit().wrap(threads::on_copy_stream(move || copier.download()));
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

/// The error of a segment whose input the host cannot take within the run's limit.
fn host_full(segment: &str, needed: u64, held: u64, limit: u64) -> Error {
    Error::OutOfMemory {
        what: format!(
            "activation offload, the input of the checkpointed segment {segment} in host \
             memory{}",
            if held > 0 {
                format!(
                    ", with the {} offload held or was copying there",
                    crate::memory::human(held)
                )
            } else {
                String::new()
            }
        ),
        needed: held + needed,
        place: "the host (`[memory] host_budget`, less what optimizer offload keeps there)"
            .to_string(),
        available: Some(limit),
        advice: "raise `memory.host_budget`, offload only larger tensors (a higher \
                 `offload.min_bytes`), checkpoint fewer segments, make the batch smaller, or \
                 turn `offload.activations` off"
            .to_string(),
    }
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
    /// segments before this one. A copy back that failed is the step's [`Error::Device`],
    /// naming the segment.
    pub(in crate::checkpoint) fn restore<C, I>(self, input: I) -> Result<I, Error>
    where
        C: CheckpointStrategy,
        I: Segment<Autodiff<B, C>>,
    {
        let taken = self.slot.take().map_err(|why| Error::Device {
            device: format!("{:?}", self.slot.device),
            message: format!(
                "the input of the checkpointed segment {} could not be brought back for its \
                 recomputation ({why}): the device may have been lost or reset; check the \
                 device, then resume from the last snapshot (`memsave train --resume`)",
                self.slot.name
            ),
        })?;
        self.slot
            .run
            .prefetch_before(Arc::as_ptr(&self.slot) as *const (), self.prefetch);
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

impl RunOffload {
    fn register(&self, slot: Arc<dyn Prefetch>) {
        let mut order = lock(&self.order);
        let list = order.entry(run::owner()).or_default();
        list.retain(|weak| weak.strong_count() > 0);
        list.push(Arc::downgrade(&slot));
    }

    /// The place the next offloaded segment of this thread's forward takes in it (1: the
    /// first), for messages: segments of one type are told apart by it.
    fn next_place(&self) -> usize {
        let mut order = lock(&self.order);
        let list = order.entry(run::owner()).or_default();
        list.retain(|weak| weak.strong_count() > 0);
        list.len() + 1
    }

    /// Drops `slot` from its thread's order and prefetches the `count` live segments before it.
    fn prefetch_before(&self, slot: *const (), count: usize) {
        let ahead: Vec<Arc<dyn Prefetch>> = {
            let mut order = lock(&self.order);
            let Some(list) = order.get_mut(&run::owner()) else {
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
}
