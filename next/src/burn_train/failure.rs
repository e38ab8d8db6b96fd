//! The error channel: how a failure that stops the training reaches the user whatever the
//! program does ([`Shared::fail`]), and the handles that tell whether anyone is left to take it
//! ([`Memsave`]'s `Clone` and `Drop`).

use burn::train::train::WorkerFailure;
use burn::train::TrainingError;

use super::{lock, Memsave, Shared};
use crate::Error;

impl Shared {
    /// Stops the training with `error`, in a way the user cannot miss. The error is kept, said
    /// as an event (target `memsave`), and:
    /// - where memsave's interrupter was given to the training ([`Memsave::interrupter`]) and a
    ///   [`Memsave`] handle is alive, burn-train's error channel stops the training after this
    ///   step (`Interrupter::fail`: `LearningResult::error` says it, as a failure of the worker
    ///   on device 0, burn-train having no variant for a library's error) and the error waits for
    ///   [`Memsave::finish`]; a program that drops its last handle without taking it gets a panic
    ///   with it then;
    /// - otherwise nothing can stop the loop but a panic (Burn's convention for misuse): the next
    ///   optimizer step, which burn-train runs on the caller of `launch`, panics with the error
    ///   and what to add to get it as a `Result` instead ([`Shared::unseen_failure`]).
    ///
    /// The first error counts.
    pub(crate) fn fail(&mut self, error: Error) {
        if self.failure.is_some() {
            return;
        }
        tracing::error!(target: "memsave", "{error}");
        if let (Some(interrupter), true) = (&self.interrupter, self.handles > 0) {
            interrupter.fail(TrainingError::Workers(vec![WorkerFailure {
                device_id: 0,
                message: format!("memsave: {error}"),
            }]));
        }
        self.failure = Some(error);
    }

    /// The failure's panic message, taken, where nothing else would show it: no interrupter
    /// stops the training, or no handle is left to call [`Memsave::finish`].
    pub(crate) fn unseen_failure(&mut self) -> Option<String> {
        let why = match (&self.interrupter, self.handles) {
            (None, _) => Unseen::NoInterrupter,
            (Some(_), 0) => Unseen::NoHandle,
            (Some(_), _) => return None,
        };
        let error = self.failure.take()?;
        Some(stopped(&error.to_string(), why))
    }
}

/// Why an error that stopped the training is said by a panic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Unseen {
    /// No interrupter was given to the training: only a panic stops the loop.
    NoInterrupter,
    /// No [`Memsave`] handle is left to call [`Memsave::finish`].
    NoHandle,
    /// The last handle was dropped without [`Memsave::finish`].
    NotTaken,
    /// The training went on after memsave stopped it: the interrupter memsave holds is not
    /// the one burn-train's loop reads.
    Ignored,
}

/// The panic message for an error that stopped the training: the error, and how to get it as
/// a `Result` instead.
pub(crate) fn stopped(message: &str, why: Unseen) -> String {
    let how = match why {
        Unseen::NoInterrupter => {
            "nothing else stops burn-train's loop: give memsave's interrupter to the training \
             (`SupervisedTraining::new(..).with_interrupter(memsave.interrupter())`) to have it \
             stopped cleanly, and take the error as a `Result` with `memsave.finish()?` after \
             `launch`"
        }
        Unseen::NoHandle => {
            "no `Memsave` handle is left to take it: keep the `Memsave` and call \
             `memsave.finish()?` after `launch`"
        }
        Unseen::Ignored => {
            "the training went on after memsave stopped it, so the interrupter memsave holds is \
             not the training's: give `memsave.interrupter()` with `with_interrupter` after any \
             interrupter of your own (or register `.metrics(memsave.metrics())` after it), and \
             take the error with `memsave.finish()?` after `launch`"
        }
        Unseen::NotTaken => {
            "the training was stopped, and the error was never taken: call `memsave.finish()?` \
             after `launch` to handle it as a `Result`"
        }
    };
    format!("memsave stopped the training: {message}\n({how})")
}

/// A clone is one more handle ([`Shared::handles`]).
impl Clone for Memsave {
    fn clone(&self) -> Self {
        lock(&self.shared).handles += 1;
        Memsave {
            shared: self.shared.clone(),
        }
    }
}

/// The last handle dropped says an error that was never taken.
impl Drop for Memsave {
    fn drop(&mut self) {
        let untaken = {
            let mut shared = lock(&self.shared);
            shared.handles = shared.handles.saturating_sub(1);
            if shared.handles == 0 {
                shared.failure.take()
            } else {
                None
            }
        };
        if let (Some(error), false) = (untaken, std::thread::panicking()) {
            panic!("{}", stopped(&error.to_string(), Unseen::NotTaken));
        }
    }
}
