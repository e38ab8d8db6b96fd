//! How long a run is (MMCV's `runner = dict(type='EpochBasedRunner', max_epochs=12)`).

use crate::{Error, Result};

/// How long a run is (MMCV's `runner = dict(type='EpochBasedRunner', max_epochs=12)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "RunnerFields")]
pub enum RunLength {
    /// `max_epochs` passes over the data (MMCV's `EpochBasedRunner`).
    Epochs(usize),
    /// `max_iters` iterations (MMCV's `IterBasedRunner`).
    Iters(usize),
}

/// [`RunLength`] as written.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RunnerFields {
    #[serde(rename = "type")]
    kind: RunnerType,
    #[serde(default)]
    max_epochs: Option<usize>,
    #[serde(default)]
    max_iters: Option<usize>,
}

#[derive(serde::Deserialize)]
enum RunnerType {
    EpochBasedRunner,
    IterBasedRunner,
}

impl TryFrom<RunnerFields> for RunLength {
    type Error = Error;

    fn try_from(fields: RunnerFields) -> Result<Self> {
        match (fields.kind, fields.max_epochs, fields.max_iters) {
            (RunnerType::EpochBasedRunner, Some(epochs), None) if epochs > 0 => {
                Ok(RunLength::Epochs(epochs))
            }
            (RunnerType::IterBasedRunner, None, Some(iters)) if iters > 0 => {
                Ok(RunLength::Iters(iters))
            }
            (RunnerType::EpochBasedRunner, _, _) => Err(Error::invalid(
                "max_epochs",
                "an EpochBasedRunner needs `max_epochs` (a positive integer) and no `max_iters`",
            )),
            (RunnerType::IterBasedRunner, _, _) => Err(Error::invalid(
                "max_iters",
                "an IterBasedRunner needs `max_iters` (a positive integer) and no `max_epochs`",
            )),
        }
    }
}

impl RunLength {
    /// Whether the run counts epochs.
    pub fn by_epoch(self) -> bool {
        matches!(self, RunLength::Epochs(_))
    }
}
