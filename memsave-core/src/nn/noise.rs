use burn::module::Module;
use burn::prelude::{Backend, Config};
use burn::tensor::{Distribution, Tensor};

use crate::checkpoint::RandomDraws;
use crate::fp16::{Fp16Module, Precision};

/// Configuration of a [`GaussianNoise`] layer.
#[derive(Config, Debug)]
pub struct GaussianNoiseConfig {
    /// Standard deviation of the noise.
    pub std: f64,
}

impl GaussianNoiseConfig {
    /// The layer.
    pub fn init(&self) -> GaussianNoise {
        GaussianNoise { std: self.std }
    }
}

/// Additive Gaussian noise (Burn's `GaussianNoise`) that draws the same noise when a
/// checkpointed segment is recomputed, in the dtype of its input (so it also runs in half).
///
/// In training (an autodiff backend) adds `N(0, std²)` noise; otherwise the input passes
/// unchanged. Inside a checkpointed segment the noise of the first forward is kept and reused by
/// the recomputation.
#[derive(Module, Clone, Debug)]
pub struct GaussianNoise {
    /// Standard deviation of the noise.
    pub std: f64,
}

impl GaussianNoise {
    /// - input: any shape
    /// - output: the shape of `input`
    pub fn forward<B: Backend, const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        if self.std == 0.0 || !B::ad_enabled(&input.device()) {
            return input;
        }
        let noise =
            crate::checkpoint::random(|| input.random_like(Distribution::Normal(0.0, self.std)));
        input + noise
    }
}

impl Fp16Module for GaussianNoise {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}

/// Replays its noise by itself.
impl RandomDraws for GaussianNoise {
    fn draws_random(&self) -> bool {
        false
    }
}
