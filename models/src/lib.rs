//! Models built with memsave: ResNet and RetinaNet (R50-FPN), their data (VOC) and evaluation.
//!
//! Empty for now: the models arrive with their own issues.
