//! Evaluation: Pascal VOC's mean average precision, detections files, and the evaluation hook
//! of the runner.

pub mod accuracy;
pub mod hook;
pub mod voc;
