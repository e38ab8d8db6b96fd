//! Models built with memsave: ResNet now; RetinaNet (R50-FPN), its data (VOC) and evaluation
//! arrive with their own issues.

pub mod resnet;
