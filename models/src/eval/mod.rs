//! Evaluation: Pascal VOC's mean average precision, detections files, and the evaluation hook
//! of the runner.

pub mod hook;
pub mod voc;
