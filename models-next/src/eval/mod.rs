//! Evaluation on Burn 0.22: Pascal VOC's mean average precision, detections files, and the
//! runner's evaluation hooks (a detector's mAP, a classifier's accuracy).

pub mod accuracy;
pub mod hook;
pub mod voc;
