//! What a thread is doing with respect to checkpointing: running a segment's first forward
//! (recording its random draws) or recomputing it (replaying them, and leaving running
//! statistics alone). A whole forward is recorded and replayed the same way when a step runs
//! its forward twice (the optimizer's step in backward under clipping or loss scaling: see
//! [`crate::train::TrainState::forward_passes`]).
//!
//! Frames nest: a segment recomputed inside another segment's recomputation replays from the
//! innermost replay frame and records for its own later recomputation.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;

/// Random values drawn inside a segment, in order (dropout masks).
pub(crate) type Draws = Vec<Box<dyn Any + Send>>;

enum Frame {
    Record(Draws),
    /// The recorded draws, and whether to draw again anyway (and discard): in a segment that
    /// runs under its own reseeded stream, so that the stream reaches Burn's layers where it
    /// did in the first forward. The last flag: a segment's recomputation (its tensors live
    /// only until its backward ends), not a whole step's second forward.
    Replay(VecDeque<Box<dyn Any + Send>>, bool, bool),
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// Whether this thread is running a forward a second time: recomputing a segment in backward,
/// or a step's second forward. Layers with running statistics (memsave's `BatchNorm`) leave
/// them alone then, so that they are updated once per step.
pub fn is_recomputing() -> bool {
    FRAMES.with(|frames| {
        frames
            .borrow()
            .iter()
            .any(|frame| matches!(frame, Frame::Replay(..)))
    })
}

/// Whether this thread is recomputing a checkpointed segment in backward (whose tensors live
/// only until its backward is done), not running a step's second forward.
pub(crate) fn is_recomputing_segment() -> bool {
    FRAMES.with(|frames| {
        frames
            .borrow()
            .iter()
            .any(|frame| matches!(frame, Frame::Replay(_, _, true)))
    })
}

/// A random value for a layer inside a segment: drawn with `draw` in a first forward (and
/// recorded), replayed in a recomputation, drawn plainly elsewhere.
pub fn random<T: Clone + Send + 'static>(draw: impl FnOnce() -> T) -> T {
    FRAMES.with(|frames| {
        let mut frames = frames.borrow_mut();
        let replay = frames
            .iter()
            .rposition(|frame| matches!(frame, Frame::Replay(..)));
        let value = match replay {
            Some(index) => {
                let Frame::Replay(queue, redraw, _) = &mut frames[index] else {
                    unreachable!("rposition found a replay frame")
                };
                if *redraw {
                    drop(draw());
                }
                let recorded = queue.pop_front().expect(
                    "a checkpointed segment drew more random values in its recomputation than \
                     in its first forward: its body must be deterministic given its input",
                );
                *recorded.downcast::<T>().expect(
                    "a checkpointed segment drew random values of another type in its \
                     recomputation: its body must be deterministic given its input",
                )
            }
            None => draw(),
        };
        record_above(&mut frames, replay, &value);
        value
    })
}

/// Pushes `value` onto the record frames above the innermost replay (`replay`): the segments
/// run for the first time, for their recomputation.
fn record_above<T: Clone + Send + 'static>(frames: &mut [Frame], replay: Option<usize>, value: &T) {
    let above = replay.map_or(0, |index| index + 1);
    for frame in &mut frames[above..] {
        if let Frame::Record(draws) = frame {
            draws.push(Box::new(value.clone()));
        }
    }
}

/// A value a layer computed in a segment's first forward, handed back in its recomputation so
/// that it is not computed again (BatchNorm's batch statistics: the same bits, without a pass
/// over the input). `None` outside a recomputation: the layer computes the value, then hands
/// it to [`record`].
pub(crate) fn replayed<T: Send + 'static>() -> Option<T> {
    FRAMES.with(|frames| {
        let mut frames = frames.borrow_mut();
        let index = frames
            .iter()
            .rposition(|frame| matches!(frame, Frame::Replay(..)))?;
        let Frame::Replay(queue, _, _) = &mut frames[index] else {
            unreachable!("rposition found a replay frame")
        };
        let recorded = queue.pop_front().expect(
            "a checkpointed segment ran more layers with recorded values in its recomputation \
             than in its first forward: its body must be deterministic given its input",
        );
        Some(*recorded.downcast::<T>().expect(
            "a checkpointed segment ran its layers in another order in its recomputation: its \
             body must be deterministic given its input",
        ))
    })
}

/// Records `value` (computed, or [`replayed`]) for the recomputation of the segments being run
/// for the first time.
pub(crate) fn record<T: Clone + Send + 'static>(value: &T) {
    FRAMES.with(|frames| {
        let mut frames = frames.borrow_mut();
        let replay = frames
            .iter()
            .rposition(|frame| matches!(frame, Frame::Replay(..)));
        record_above(&mut frames, replay, value);
    })
}

/// Runs `f` as a segment's first forward; returns its result and the random values it drew.
pub(crate) fn recording<R>(f: impl FnOnce() -> R) -> (R, Draws) {
    FRAMES.with(|frames| frames.borrow_mut().push(Frame::Record(Vec::new())));
    let _pop = PopFrame;
    let result = f();
    let draws = FRAMES.with(|frames| match frames.borrow_mut().last_mut() {
        Some(Frame::Record(draws)) => std::mem::take(draws),
        _ => unreachable!("the record frame pushed above is on top"),
    });
    (result, draws)
}

/// Runs `f` as a recomputation that replays `draws`; with `redraw`, each replayed value is
/// drawn again too (and discarded), to keep the global stream where the first forward had it.
pub(crate) fn replaying<R>(draws: Draws, redraw: bool, f: impl FnOnce() -> R) -> R {
    FRAMES.with(|frames| {
        frames
            .borrow_mut()
            .push(Frame::Replay(draws.into_iter().collect(), redraw, true))
    });
    let _pop = PopFrame;
    f()
}

/// Runs `f`, a step's forward run a second time, replaying the `draws` its first run recorded
/// ([`recording`]): the same dropout masks and batch statistics, running statistics left alone.
pub(crate) fn repeating<R>(draws: Draws, f: impl FnOnce() -> R) -> R {
    FRAMES.with(|frames| {
        frames
            .borrow_mut()
            .push(Frame::Replay(draws.into_iter().collect(), false, false))
    });
    let _pop = PopFrame;
    f()
}

/// Pops the frame pushed with it, also when the segment unwinds.
struct PopFrame;

impl Drop for PopFrame {
    fn drop(&mut self) {
        FRAMES.with(|frames| frames.borrow_mut().pop());
    }
}
