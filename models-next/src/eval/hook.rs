//! Running a detector over a VOC split: its detections as records ([`detect`]), and the
//! runner's evaluation hook (MMDetection's `EvalHook`), which scores the model on the
//! validation split every `evaluation.interval` epochs (or iterations) and logs the table and
//! the mAP.

use std::io::Write;

use burn::prelude::*;

use super::voc::{voc_map, ApMode, DetectionRecord, MapResult};
use crate::data::voc::loader::VocDetection;
use crate::data::voc::VOC_CLASSES;
use crate::detection::retinanet::RetinaNet;
use crate::memsave::train::{DataSource, Hook, TrainState};
use crate::memsave::{Error, Result};

/// The detections of `model` on every image of `data` (in order, unflipped), in the original
/// images' pixels. It runs without autodiff (on `model.valid()`, the batches on `data`'s device
/// without autodiff), whichever device `data` was made for.
pub fn detect(model: &RetinaNet, data: &VocDetection) -> Result<Vec<DetectionRecord>> {
    let model = model.valid();
    let device = data.device().clone().inner();
    let mut records = Vec::new();
    for index in 0..data.batches_per_epoch() {
        let batch = data.batch(0, index, &device)?;
        let detections = model.predict(batch.images, &batch.metas);
        for (meta, dets) in batch.metas.iter().zip(detections) {
            for d in dets {
                let class = VOC_CLASSES.get(d.label).ok_or_else(|| {
                    Error::invalid(
                        "model.bbox_head.num_classes",
                        format!(
                            "a VOC detector tells the {} VOC classes apart; this one gave \
                             class {}",
                            VOC_CLASSES.len(),
                            d.label
                        ),
                    )
                })?;
                records.push(DetectionRecord {
                    image: meta.id.clone(),
                    class: class.to_string(),
                    score: d.score,
                    bbox: d.bbox,
                });
            }
        }
    }
    Ok(records)
}

/// Detects on `data` and scores the detections.
pub fn evaluate(
    model: &RetinaNet,
    data: &VocDetection,
    mode: ApMode,
) -> Result<(Vec<DetectionRecord>, MapResult)> {
    let records = detect(model, data)?;
    let result = voc_map(data.images(), &records, 0.5, mode)?;
    Ok((records, result))
}

/// Scores the model on a VOC split during training.
pub struct EvalHook {
    data: VocDetection,
    interval: usize,
    by_epoch: bool,
    mode: ApMode,
    /// The mAP of each evaluation: `(epoch or iteration, mAP)`.
    pub history: Vec<(usize, f32)>,
}

impl EvalHook {
    /// Every `interval` epochs (`by_epoch`) or iterations, on `data`, with `mode`.
    pub fn new(data: VocDetection, interval: usize, by_epoch: bool, mode: ApMode) -> Result<Self> {
        if interval == 0 {
            return Err(Error::invalid("evaluation.interval", "must be at least 1"));
        }
        Ok(EvalHook {
            data,
            interval,
            by_epoch,
            mode,
            history: Vec::new(),
        })
    }
}

impl EvalHook {
    fn run(&mut self, state: &mut TrainState<RetinaNet>, at: usize) -> Result<()> {
        let (_, result) = evaluate(&state.model, &self.data, self.mode)?;
        let unit = if self.by_epoch { "epoch" } else { "iter" };
        let text = format!(
            "evaluation at {unit} {at} ({} images):\n{result}",
            self.data.images().len()
        );
        log(&state.work_dir, &text)?;
        self.history.push((at, result.map));
        Ok(())
    }
}

impl Hook<RetinaNet> for EvalHook {
    fn name(&self) -> &'static str {
        "EvalHook"
    }

    fn after_iter(&mut self, state: &mut TrainState<RetinaNet>) -> Result<()> {
        match due(state, self.by_epoch, false, self.interval) {
            Some(at) => self.run(state, at),
            None => Ok(()),
        }
    }

    fn after_epoch(&mut self, state: &mut TrainState<RetinaNet>) -> Result<()> {
        match due(state, self.by_epoch, true, self.interval) {
            Some(at) => self.run(state, at),
            None => Ok(()),
        }
    }
}

/// The epoch (`at_epoch_end`) or iteration an evaluation is due at now, if one is: every
/// `interval` epochs of an epoch-based run (`by_epoch`) or iterations of an iteration-based one,
/// on rank 0 only (it evaluates a data-parallel run).
pub(crate) fn due<M: crate::memsave::train::TrainModel>(
    state: &TrainState<M>,
    by_epoch: bool,
    at_epoch_end: bool,
    interval: usize,
) -> Option<usize> {
    let at = if at_epoch_end {
        state.epoch + 1
    } else {
        state.iter + 1
    };
    (state.is_main() && by_epoch == at_epoch_end && at % interval == 0).then_some(at)
}

/// An evaluation's text, as a `tracing` event (target `memsave`, `kind = "log"`: the command
/// line prints it) and appended to `train.log` in `work_dir`.
pub(crate) fn log(work_dir: &std::path::Path, text: &str) -> Result<()> {
    tracing::info!(target: "memsave", kind = "log", "{text}");
    let path = work_dir.join("train.log");
    let io = |source| Error::Io {
        path: path.clone(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io)?;
    writeln!(file, "{text}").map_err(io)
}
