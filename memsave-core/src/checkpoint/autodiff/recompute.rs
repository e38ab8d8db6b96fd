//! The recomputation of a segment in backward, on a helper thread (see [`super::super::threads`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::Backend;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use super::super::context::{self, Draws};
use super::super::segment::{floats, Segment};
use super::super::threads;
use super::nodes::{placeholder, tapped_leaf, unary, Barrier, GradValue, Seed};
use super::{Ad, Ended, Grads, Key, Message};
// ---------------------------------------------------------------------------------------------
// Recomputation.

/// Runs on the thread of the outer backward: starts the helper, waits for its gradients.
pub(super) fn recompute<B, C, M, I, O, F>(
    module: M,
    input: I,
    segment: F,
    draws: Draws,
    stream: Option<u64>,
    output_grads: Vec<Option<FloatTensor<B>>>,
    id: Option<crate::checkpoint::SegmentId>,
) -> Result<Grads<B>, Ended>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Module<Ad<B, C>> + 'static,
    I: Segment<Ad<B, C>>,
    O: Segment<Ad<B, C>>,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    let input_count = floats(&input).len();
    let started = crate::checkpoint::profile::live_if_recording();
    let (sender, receiver) = mpsc::channel::<Message<B>>();
    threads::spawn(move || {
        let report = sender.clone();
        // A thread boundary: the segment's code is the user's and may panic; the outer backward
        // resumes the panic with its message.
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            context::replaying(draws, stream.is_some(), || {
                backprop_segment::<B, C, M, I, O, F>(
                    module,
                    input,
                    segment,
                    stream,
                    output_grads,
                    sender,
                    id,
                )
            })
        }));
        if let Err(payload) = outcome {
            let _ = report.send(Message::Panicked(
                crate::panic_text(payload.as_ref())
                    .unwrap_or("(no message)")
                    .to_string(),
            ));
        }
    })
    .map_err(|source| {
        Ended::Failed(crate::Error::Thread {
            what: "a recompute thread for a checkpointed segment".to_string(),
            source,
        })
    })?;

    let lost = || {
        Ended::Panicked(
            "memsave: the recompute thread of a checkpointed segment ended without its gradients"
                .to_string(),
        )
    };
    let mut grads = Grads {
        inputs: vec![None; input_count],
        params: Vec::new(),
    };
    loop {
        match receiver.recv().map_err(|_| lost())? {
            Message::Grad(Key::Input(index), grad) => grads.inputs[index] = Some(grad),
            Message::Grad(Key::Param(node), grad) => grads.params.push((node, grad)),
            Message::Done => {
                // What the helper keeps until the outer backward ends, beside the gradients.
                if let (Some(started), Some(id)) = (started, id) {
                    let sent: u64 = grads
                        .inputs
                        .iter()
                        .flatten()
                        .chain(grads.params.iter().map(|(_, grad)| grad))
                        .map(|grad: &FloatTensor<B>| {
                            let shape = grad.shape();
                            (shape.num_elements() * grad.dtype().size()) as u64
                        })
                        .sum();
                    crate::checkpoint::profile::released(id, started, sent);
                }
                return Ok(grads);
            }
            Message::Panicked(message) => return Err(Ended::Panicked(recompute_panic(&message))),
        }
    }
}

pub(super) fn recompute_panic(message: &str) -> String {
    format!(
        "memsave: a checkpointed segment panicked while it was recomputed in backward: {message}"
    )
}

/// Runs on the helper thread: recompute from fresh leaves, seed the outputs with their
/// gradients, back-propagate.
pub(super) fn backprop_segment<B, C, M, I, O, F>(
    module: M,
    input: I,
    segment: F,
    stream: Option<u64>,
    output_grads: Vec<Option<FloatTensor<B>>>,
    sender: mpsc::Sender<Message<B>>,
    id: Option<crate::checkpoint::SegmentId>,
) where
    B: Backend,
    C: CheckpointStrategy,
    M: Module<Ad<B, C>> + 'static,
    I: Segment<Ad<B, C>>,
    O: Segment<Ad<B, C>>,
    F: Fn(&M, I) -> O + Send + Sync + 'static,
{
    let mut index = 0;
    let input = input.map_floats(&mut |tensor| {
        let key = Key::Input(index);
        index += 1;
        let tracked = tensor.is_tracked();
        let value = Ad::<B, C>::inner(tensor);
        if tracked {
            tapped_leaf::<B, C>(value, key, &sender)
        } else {
            Ad::<B, C>::from_inner(value)
        }
    });
    let module = module.map(&mut FreshLeaves::<B, C> {
        sender: sender.clone(),
        _strategy: std::marker::PhantomData,
    });

    // The segment's own random stream, where its first forward started it.
    if let (Some(seed), Some(first)) = (stream, floats(&input).first()) {
        Ad::<B, C>::seed(&Ad::<B, C>::float_device(first), seed);
    }
    let device = floats(&input)
        .first()
        .map(|first| Ad::<B, C>::float_device(first));
    let sync = || {
        if let Some(device) = &device {
            let _ = B::sync(device);
        }
    };
    let output = crate::checkpoint::profile::recompute(id, sync, || {
        crate::memory::scope(crate::memory::phase::RECOMPUTE, || segment(&module, input))
    });

    // The anchor only runs once an output has its gradient: there is one to size things by.
    let like = output_grads
        .iter()
        .flatten()
        .next()
        .map(placeholder::<B>)
        .expect("an output gradient reached the checkpoint");
    let mut roots: Vec<FloatTensor<Ad<B, C>>> = Vec::new();
    for (y, dy) in floats(&output).into_iter().zip(output_grads) {
        if let Some(dy) = dy {
            let placeholder = placeholder::<B>(&dy);
            roots.push(unary::<B, C, _>(Seed, &y, GradValue(dy), placeholder));
        }
    }
    drop(output);
    drop(module);
    let barrier_leaf =
        Ad::<B, C>::float_set_require_grad(Ad::<B, C>::from_inner(like.clone()), true);
    roots.push(unary::<B, C, _>(Barrier, &barrier_leaf, sender, like));
    let root = roots
        .into_iter()
        .reduce(Ad::<B, C>::float_add)
        .expect("the barrier is a root");
    // Returns only after the outer backward has released its lock (see `threads`); the taps and
    // the barrier have reported long before.
    drop(Ad::<B, C>::backward(root));
}

/// Copies of the trainable parameters as fresh leaves behind taps. Frozen parameters and
/// running statistics (which are not tracked) are left as they are.
pub(super) struct FreshLeaves<B: Backend, C: CheckpointStrategy> {
    sender: mpsc::Sender<Message<B>>,
    _strategy: std::marker::PhantomData<C>,
}

impl<B: Backend, C: CheckpointStrategy> ModuleMapper<Ad<B, C>> for FreshLeaves<B, C> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Ad<B, C>, D>>,
    ) -> Param<Tensor<Ad<B, C>, D>> {
        let (id, tensor, mapper) = param.consume();
        let primitive = tensor.into_primitive().tensor();
        // Tracked, not only leaves: in a segment nested in another's recomputation, the
        // parameters are the outer recomputation's taps. Left in place they would tie this
        // recomputation to the outer one's graph, which its backward holds locked.
        let value = if primitive.is_tracked() {
            let original = primitive.node.id;
            let value = Ad::<B, C>::inner(primitive);
            tapped_leaf::<B, C>(value, Key::Param(original), &self.sender)
        } else {
            primitive
        };
        Param::from_mapped_value(
            id,
            Tensor::from_primitive(TensorPrimitive::Float(value)),
            mapper,
        )
    }
}
