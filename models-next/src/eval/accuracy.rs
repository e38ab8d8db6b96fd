//! A classifier's evaluation during training (MMClassification's `EvalHook` with
//! `metric='accuracy'`): top-1 accuracy and the mean loss on held-out samples, every
//! `evaluation.interval` epochs (or iterations), in the log.

use burn::prelude::*;

use super::hook::due;
use crate::classifier::ImageClassifier;
use crate::data::synthetic::SyntheticClassification;
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

/// Scores `model` on every batch of `data` (epoch 0, in order). It runs without autodiff (on
/// `model.valid()`, the batches on `data`'s device without autodiff).
pub fn accuracy(model: &ImageClassifier, data: &SyntheticClassification) -> Result<Accuracy> {
    let model = model.valid();
    let device = data.device().clone().inner();
    let (mut correct, mut samples, mut loss_sum) = (0usize, 0usize, 0.0f64);
    for index in 0..data.batches_per_epoch() {
        let batch = data.batch(0, index, &device)?;
        let n = batch.labels.dims()[0];
        let logits = model.forward(batch.images);
        let loss = model.head_loss(logits.clone(), batch.labels.clone());
        loss_sum += scalar(loss) * n as f64;
        let predicted: Tensor<1, Int> = logits.argmax(1).flatten(0, 1);
        let hits = predicted.equal(batch.labels).int().sum();
        correct += hits
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
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

fn scalar(tensor: Tensor<1>) -> f64 {
    tensor
        .cast(burn::tensor::DType::F32)
        .into_data()
        .try_to_vec::<f32>()
        .map(|v| v[0] as f64)
        .unwrap_or(f64::NAN)
}

/// Scores the classifier on held-out samples during training.
pub struct AccuracyHook {
    data: SyntheticClassification,
    interval: usize,
    by_epoch: bool,
    /// Each evaluation: `(epoch or iteration, result)`.
    pub history: Vec<(usize, Accuracy)>,
}

impl AccuracyHook {
    /// Every `interval` epochs (`by_epoch`) or iterations, on `data`.
    pub fn new(data: SyntheticClassification, interval: usize, by_epoch: bool) -> Result<Self> {
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

impl AccuracyHook {
    fn run(&mut self, state: &mut TrainState<ImageClassifier>, at: usize) -> Result<()> {
        let result = accuracy(&state.model, &self.data)?;
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

impl Hook<ImageClassifier> for AccuracyHook {
    fn name(&self) -> &'static str {
        "EvalHook"
    }

    fn after_iter(&mut self, state: &mut TrainState<ImageClassifier>) -> Result<()> {
        match due(state, self.by_epoch, false, self.interval) {
            Some(at) => self.run(state, at),
            None => Ok(()),
        }
    }

    fn after_epoch(&mut self, state: &mut TrainState<ImageClassifier>) -> Result<()> {
        match due(state, self.by_epoch, true, self.interval) {
            Some(at) => self.run(state, at),
            None => Ok(()),
        }
    }
}
