//! The scheduler adapter: the user's learning-rate schedule, stepped once per optimizer step.

use std::sync::{Arc, Mutex};

use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::LearningRate;
use burn::prelude::Backend;

use super::{lock, Shared};

/// The user's Burn scheduler, stepped at the first micro-batch of each group and held through
/// the group (burn-train steps it on every micro-batch): a schedule written in optimizer steps
/// stays in optimizer steps under accumulation. Its record is the inner one's and the rate held.
#[derive(Clone)]
pub struct MemsaveScheduler<S> {
    inner: S,
    current: Option<LearningRate>,
    shared: Arc<Mutex<Shared>>,
}

impl<S> MemsaveScheduler<S> {
    pub(crate) fn new(inner: S, shared: Arc<Mutex<Shared>>) -> Self {
        MemsaveScheduler {
            inner,
            current: None,
            shared,
        }
    }
}

impl<S: LrScheduler> LrScheduler for MemsaveScheduler<S> {
    type Record<B: Backend> = (S::Record<B>, Option<LearningRate>);

    fn step(&mut self) -> LearningRate {
        let starts_group = {
            let shared = lock(&self.shared);
            shared
                .iter
                .is_multiple_of(shared.groups().cumulative_iters())
        };
        match self.current {
            Some(lr) if !starts_group => lr,
            _ => *self.current.insert(self.inner.step()),
        }
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {
        (self.inner.to_record::<B>(), self.current)
    }

    fn load_record<B: Backend>(self, record: Self::Record<B>) -> Self {
        let (inner, current) = record;
        MemsaveScheduler {
            inner: self.inner.load_record::<B>(inner),
            current,
            shared: self.shared,
        }
    }
}
