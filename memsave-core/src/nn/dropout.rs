use burn::module::Module;
use burn::prelude::{Backend, Config};
use burn::tensor::{Distribution, Tensor};

use crate::fp16::{Fp16Module, Precision};

/// Configuration of a [`Dropout`] layer.
#[derive(Config, Debug)]
pub struct DropoutConfig {
    /// Probability of zeroing an element, in `[0, 1)`.
    pub prob: f64,
}

impl DropoutConfig {
    /// The layer.
    ///
    /// # Panics
    /// If `prob` is outside `[0, 1)` (a programming error in the model definition).
    pub fn init(&self) -> Dropout {
        assert!(
            (0.0..1.0).contains(&self.prob),
            "Dropout: prob must be in [0, 1), got {}",
            self.prob
        );
        Dropout { prob: self.prob }
    }
}

/// Dropout that draws the same mask when a checkpointed segment is recomputed.
///
/// In training (an autodiff backend) each element is zeroed with probability `prob` and the
/// rest scaled by `1 / (1 - prob)`; otherwise the input passes unchanged. Inside a checkpointed
/// segment the mask of the first forward is kept (one byte per element) and reused by the
/// recomputation, so gradients equal those without checkpointing and the global random stream
/// is drawn from exactly as often.
#[derive(Module, Clone, Debug)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub prob: f64,
}

impl Dropout {
    /// - input: any shape
    /// - output: the shape of `input`
    pub fn forward<B: Backend, const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        if self.prob == 0.0 || !B::ad_enabled(&input.device()) {
            return input;
        }
        let keep_prob = 1.0 - self.prob;
        let dropped = crate::checkpoint::random(|| {
            input
                .random_like(Distribution::Bernoulli(keep_prob))
                .lower_elem(0.5)
        });
        input.mask_fill(dropped, 0.0).div_scalar(keep_prob)
    }
}

impl Fp16Module for Dropout {
    fn wrap_fp16(self, _precision: Precision) -> Self {
        self
    }
}
