//! Training data on Burn 0.22: the synthetic classification set so far (Pascal VOC comes with
//! the port's next slice; data-parallel shards with the collective).

pub mod synthetic;
