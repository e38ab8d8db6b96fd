use burn::module::{Module, Param, RunningState};
use burn::prelude::{Backend, Config};
use burn::tensor::Tensor;

use crate::fp16::{Fp16, Fp16Module, HasFp16Flag, Precision};

/// Configuration of a [`BatchNorm`] layer (PyTorch's `BatchNorm2d` defaults).
#[derive(Config, Debug)]
pub struct BatchNormConfig {
    /// Number of channels (`C` of `[N, C, ...]`).
    pub num_features: usize,
    /// Added to the variance for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Weight of the current batch in the running statistics.
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl BatchNormConfig {
    /// A layer with `gamma = 1`, `beta = 0`, running mean 0 and running variance 1.
    pub fn init<B: Backend>(&self, device: &B::Device) -> BatchNorm<B> {
        let ones = Tensor::ones([self.num_features], device);
        let zeros = Tensor::zeros([self.num_features], device);
        BatchNorm {
            gamma: Param::from_tensor(ones.clone()),
            beta: Param::from_tensor(zeros.clone()),
            running_mean: RunningState::new(zeros),
            running_var: RunningState::new(ones),
            momentum: self.momentum,
            epsilon: self.epsilon,
            fp16_enabled: Fp16::Off,
        }
    }
}

/// Batch normalisation over `[batch, channels, ...]`, with PyTorch's semantics, that stays in
/// fp32 inside a half-precision model.
///
/// On an autodiff backend it normalises with the batch statistics and updates the running ones
/// (running variance with the unbiased batch variance, as PyTorch); otherwise it normalises with
/// the running statistics. Inside a checkpointed segment the running statistics are updated
/// in the first forward only, not again in the recomputation.
#[derive(Module, Debug)]
pub struct BatchNorm<B: Backend> {
    /// Scale, `[channels]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[channels]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Running mean, `[channels]`.
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// Running variance, `[channels]`.
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Weight of the current batch in the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    /// On: the input is cast to fp32 and the output back to half.
    pub fp16_enabled: Fp16,
}

impl<B: Backend> BatchNorm<B> {
    /// Normalises `input` per channel.
    ///
    /// - input: `[batch, channels, ...]`, fp32 (or half when the fp16 flag is on)
    /// - output: the shape of `input`; fp32, or half when the flag is on
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        assert!(
            D >= 2,
            "BatchNorm takes [batch, channels, ...], got a {D}-d tensor"
        );
        let input = self.fp16_enabled.to_fp32(input);
        let output = if B::ad_enabled(&input.device()) {
            self.forward_train(input)
        } else {
            self.forward_eval(input)
        };
        self.fp16_enabled.to_half(output)
    }

    fn forward_train<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let dims = input.dims();
        let channels = dims[1];
        let count = input.shape().num_elements() / channels;
        // [C, N * spatial]: one row per channel.
        let rows = input.clone().swap_dims(0, 1).reshape([channels, count]);
        let mean = rows.clone().mean_dim(1);
        let var = rows.sub(mean.clone()).square().mean_dim(1);
        let mean = mean.reshape([channels]);
        let var = var.reshape([channels]);

        let unbiased = if count > 1 {
            count as f64 / (count - 1) as f64
        } else {
            1.0
        };
        // A checkpointed segment runs twice per step; the statistics move in its first
        // forward only (PyTorch updates them in both).
        if !crate::checkpoint::is_recomputing() {
            let running_mean = self.running_mean.value_sync().to_device(&input.device());
            let running_var = self.running_var.value_sync().to_device(&input.device());
            self.running_mean.update(
                running_mean.mul_scalar(1.0 - self.momentum)
                    + mean.clone().detach().mul_scalar(self.momentum),
            );
            self.running_var.update(
                running_var.mul_scalar(1.0 - self.momentum)
                    + var.clone().detach().mul_scalar(self.momentum * unbiased),
            );
        }
        self.normalise(input, mean, var)
    }

    fn forward_eval<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let device = input.device();
        let mean = self.running_mean.value().to_device(&device);
        let var = self.running_var.value().to_device(&device);
        self.normalise(input, mean, var)
    }

    /// `(input - mean) / sqrt(var + eps) * gamma + beta`, with `[C]` statistics.
    fn normalise<const D: usize>(
        &self,
        input: Tensor<B, D>,
        mean: Tensor<B, 1>,
        var: Tensor<B, 1>,
    ) -> Tensor<B, D> {
        let mut shape = [1; D];
        shape[1] = input.dims()[1];
        let inv_std = var.add_scalar(self.epsilon).sqrt().recip();
        let scale = (self.gamma.val() * inv_std).reshape(shape);
        let centred = input - mean.reshape(shape);
        centred * scale + self.beta.val().reshape(shape)
    }
}

impl<B: Backend> HasFp16Flag for BatchNorm<B> {
    fn fp16_enabled(&self) -> Fp16 {
        self.fp16_enabled
    }
}

/// Parameters and statistics stay fp32; only the flag is switched on.
impl<B: Backend> Fp16Module for BatchNorm<B> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Self {
            fp16_enabled: Fp16::On(precision),
            ..self
        }
    }
}
