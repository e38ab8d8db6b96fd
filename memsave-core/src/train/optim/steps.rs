//! An optimizer's per-parameter steps, its state taken out while a backward pass steps the
//! parameters one by one.

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::SimpleOptimizer;
use burn::optim::{Adam, AdamW, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use super::optimizer::Optim;
use crate::train::optim8::{Adam8, Sgd8};

/// An optimizer's per-parameter step, with its state taken out of the optimizer while a
/// backward pass steps the parameters one by one as their gradients become final
/// ([`Optim::take_steps`], [`Optim::put_back`]). Each step is the optimizer's own arithmetic
/// on the same tensors as [`Optim::step`]'s: the same bits.
pub(crate) enum ParamSteps<B: AutodiffBackend> {
    Sgd(StepsOf<burn::optim::Sgd<B::InnerBackend>, B>),
    Adam(StepsOf<Adam, B>),
    AdamW(StepsOf<AdamW, B>),
    Sgd8(StepsOf<Sgd8, B>),
    Adam8(StepsOf<Adam8, B>),
}

/// One optimizer's rule and the state of each parameter.
pub(crate) struct StepsOf<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
    optim: O,
    records: std::collections::HashMap<ParamId, AdaptorRecord<O, B>>,
}

impl<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> StepsOf<O, B> {
    fn take<M: AutodiffModule<B>>(adaptor: &mut OptimizerAdaptor<O, M, B>) -> Self {
        let records = adaptor.to_record().into_iter().collect();
        *adaptor = adaptor.clone().load_record(Default::default());
        StepsOf {
            optim: adaptor.optim().clone(),
            records,
        }
    }

    fn put_back<M: AutodiffModule<B>>(self, adaptor: &mut OptimizerAdaptor<O, M, B>) {
        *adaptor = adaptor
            .clone()
            .load_record(self.records.into_iter().collect());
    }

    /// As `OptimizerAdaptor`'s step of one parameter.
    fn step<const D: usize>(
        &mut self,
        lr: f64,
        id: ParamId,
        tensor: Tensor<B::InnerBackend, D>,
        grad: Tensor<B::InnerBackend, D>,
    ) -> Tensor<B::InnerBackend, D> {
        let device = grad.device();
        let (key, record) = self.records.remove_entry(&id).unzip();
        let (tensor, state) = self.optim.step(
            lr,
            tensor,
            grad,
            record.map(|record| O::to_device(record.into_state(), &device)),
        );
        if let Some(state) = state {
            self.records
                .insert(key.unwrap_or(id), AdaptorRecord::from_state(state));
        }
        tensor
    }
}

// `ParamSteps::step` dispatches to the `step` of each optimizer's steps with the same
// signature: the repeated lines are the signature, not logic.
impl<B: AutodiffBackend> ParamSteps<B> {
    /// Steps the parameter `id` of value `tensor` with its final gradient `grad`.
    pub(crate) fn step<const D: usize>(
        &mut self,
        lr: f64,
        id: ParamId,
        tensor: Tensor<B::InnerBackend, D>,
        grad: Tensor<B::InnerBackend, D>,
    ) -> Tensor<B::InnerBackend, D> {
        match self {
            ParamSteps::Sgd(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::Adam(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::AdamW(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::Sgd8(steps) => steps.step(lr, id, tensor, grad),
            ParamSteps::Adam8(steps) => steps.step(lr, id, tensor, grad),
        }
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Optim<B, M> {
    /// The per-parameter steps, the state moved out of the optimizer (no second copy of it
    /// exists while they run); [`Optim::put_back`] returns it.
    pub(crate) fn take_steps(&mut self) -> ParamSteps<B> {
        match self {
            Optim::Sgd(optim) => ParamSteps::Sgd(StepsOf::take(optim)),
            Optim::Adam(optim) => ParamSteps::Adam(StepsOf::take(optim)),
            Optim::AdamW(optim) => ParamSteps::AdamW(StepsOf::take(optim)),
            Optim::Sgd8(optim) => ParamSteps::Sgd8(StepsOf::take(optim)),
            Optim::Adam8(optim) => ParamSteps::Adam8(StepsOf::take(optim)),
        }
    }

    /// Returns the state [`Optim::take_steps`] took, as the steps left it.
    pub(crate) fn put_back(&mut self, steps: ParamSteps<B>) {
        match (self, steps) {
            (Optim::Sgd(optim), ParamSteps::Sgd(steps)) => steps.put_back(optim),
            (Optim::Adam(optim), ParamSteps::Adam(steps)) => steps.put_back(optim),
            (Optim::AdamW(optim), ParamSteps::AdamW(steps)) => steps.put_back(optim),
            (Optim::Sgd8(optim), ParamSteps::Sgd8(steps)) => steps.put_back(optim),
            (Optim::Adam8(optim), ParamSteps::Adam8(steps)) => steps.put_back(optim),
            _ => unreachable!("the steps were taken from this optimizer"),
        }
    }
}
