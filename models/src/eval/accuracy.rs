//! A classifier's evaluation during training (MMClassification's `EvalHook` with
//! `metric='accuracy'`): top-1 accuracy and the mean loss on held-out samples, every
//! `evaluation.interval` epochs (or iterations), in the log.

use burn::module::AutodiffModule;
use burn::prelude::{Backend, Int, Tensor};
use burn::tensor::backend::AutodiffBackend;

use super::hook::due;
use crate::classifier::ImageClassifier;
use crate::data::SyntheticClassification;
use crate::memsave::train::{DataSource, Hook, TrainState};
use crate::memsave::{Error, Result};

/// Top-1 accuracy and mean loss of a classifier on a data set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Accuracy {
    /// Correct / all, in `[0, 1]`.
    pub top1: f64,
    /// The mean cross-entropy.
    pub loss: f64,
    /// Samples scored.
    pub samples: usize,
}

/// Scores `model` on every batch of `data` (epoch 0, in order).
pub fn accuracy<B: crate::memsave::Backend>(
    model: &ImageClassifier<B>,
    data: &SyntheticClassification<B>,
) -> Result<Accuracy> {
    let (mut correct, mut samples, mut loss_sum) = (0usize, 0usize, 0.0f64);
    for index in 0..data.batches_per_epoch() {
        let batch = data.batch(0, index, data.device())?;
        let n = batch.labels.dims()[0];
        let logits = model.forward(batch.images);
        let loss = model.head_loss(logits.clone(), batch.labels.clone());
        loss_sum += scalar(loss) * n as f64;
        let predicted: Tensor<B, 1, Int> = logits.argmax(1).flatten(0, 1);
        let hits = predicted.equal(batch.labels).int().sum();
        correct += hits
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .map_err(|e| Error::Data(format!("accuracy: {e:?}")))?[0] as usize;
        samples += n;
    }
    if samples == 0 {
        return Err(Error::Data("the held-out set has no sample".into()));
    }
    Ok(Accuracy {
        top1: correct as f64 / samples as f64,
        loss: loss_sum / samples as f64,
        samples,
    })
}

fn scalar<B: Backend>(tensor: Tensor<B, 1>) -> f64 {
    tensor
        .cast(burn::tensor::DType::F32)
        .into_data()
        .to_vec::<f32>()
        .map(|v| v[0] as f64)
        .unwrap_or(f64::NAN)
}

/// Scores the classifier on held-out samples during training.
pub struct AccuracyHook<B: AutodiffBackend> {
    data: SyntheticClassification<B::InnerBackend>,
    interval: usize,
    by_epoch: bool,
    /// Each evaluation: `(epoch or iteration, result)`.
    pub history: Vec<(usize, Accuracy)>,
}

impl<B: AutodiffBackend> AccuracyHook<B> {
    /// Every `interval` epochs (`by_epoch`) or iterations, on `data`.
    pub fn new(
        data: SyntheticClassification<B::InnerBackend>,
        interval: usize,
        by_epoch: bool,
    ) -> Result<Self> {
        if interval == 0 {
            return Err(Error::invalid("evaluation.interval", "must be at least 1"));
        }
        Ok(AccuracyHook {
            data,
            interval,
            by_epoch,
            history: Vec::new(),
        })
    }
}

impl<B> AccuracyHook<B>
where
    B: AutodiffBackend + crate::memsave::Backend,
    B::InnerBackend: crate::memsave::Backend,
{
    fn run(&mut self, state: &mut TrainState<B, ImageClassifier<B>>, at: usize) -> Result<()> {
        let model = state.model.valid();
        let result = accuracy(&model, &self.data)?;
        let unit = if self.by_epoch { "Epoch" } else { "Iter" };
        let text = format!(
            "{unit}(val) [{at}]  accuracy_top-1: {:.2}  loss: {:.4}  ({} held-out samples)",
            100.0 * result.top1,
            result.loss,
            result.samples
        );
        super::hook::log(&state.work_dir, &text)?;
        self.history.push((at, result));
        Ok(())
    }
}

impl<B> Hook<B, ImageClassifier<B>> for AccuracyHook<B>
where
    B: AutodiffBackend + crate::memsave::Backend,
    B::InnerBackend: crate::memsave::Backend,
{
    fn name(&self) -> &'static str {
        "EvalHook"
    }

    fn after_iter(&mut self, state: &mut TrainState<B, ImageClassifier<B>>) -> Result<()> {
        match due(state, self.by_epoch, false, self.interval) {
            Some(at) => self.run(state, at),
            None => Ok(()),
        }
    }

    fn after_epoch(&mut self, state: &mut TrainState<B, ImageClassifier<B>>) -> Result<()> {
        match due(state, self.by_epoch, true, self.interval) {
            Some(at) => self.run(state, at),
            None => Ok(()),
        }
    }
}
