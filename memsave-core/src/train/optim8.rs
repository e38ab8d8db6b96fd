//! SGD with momentum, Adam and AdamW keeping their state in 8 bits ([`super::quant`]): the
//! momentum buffer and the first moment signed, Adam's second moment unsigned. Each step
//! dequantizes the parameter's state, updates it in fp32 with Burn's own arithmetic (the same
//! operations in the same order as `burn::optim::{Sgd, Adam, AdamW}`: with the state kept in
//! fp32, as it is for tensors under [`super::quant::MIN_ELEMENTS`] values, the same bits), and
//! quantizes it again.

use burn::optim::SimpleOptimizer;
use burn::prelude::Backend;
use burn::record::Record;
use burn::tensor::Tensor;

use super::quant::StateTensor;

/// SGD (PyTorch's, Burn's) with its momentum buffer in 8 bits.
#[derive(Clone, Debug)]
pub struct Sgd8 {
    pub(crate) momentum: f64,
    pub(crate) dampening: f64,
    pub(crate) nesterov: bool,
    /// L2 penalty added to the gradient.
    pub(crate) weight_decay: Option<f32>,
    /// Whether large buffers are kept in 8 bits (else as Burn's SGD: fp32).
    pub(crate) eight_bit: bool,
}

/// [`Sgd8`]'s state of one parameter.
#[derive(Record, Clone)]
pub struct Sgd8State<B: Backend, const D: usize> {
    /// The momentum buffer (none without momentum).
    pub velocity: Option<StateTensor<B, D>>,
}

// `Sgd8` and `Adam8` repeat Burn's `SimpleOptimizer::step` signature, as each impl must; their
// bodies (the two rules) share nothing.
impl<B: Backend> SimpleOptimizer<B> for Sgd8 {
    type State<const D: usize> = Sgd8State<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        mut grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        if let Some(penalty) = self.weight_decay {
            grad = tensor.clone().mul_scalar(penalty).add(grad);
        }
        let mut kept = None;
        if self.momentum > 0.0 {
            let previous = state.and_then(|state| state.velocity);
            let velocity = match previous {
                Some(previous) => grad
                    .clone()
                    .mul_scalar(1.0 - self.dampening)
                    .add(previous.load().mul_scalar(self.momentum)),
                None => grad.clone(),
            };
            grad = if self.nesterov {
                velocity.clone().mul_scalar(self.momentum).add(grad)
            } else {
                velocity.clone()
            };
            kept = Some(StateTensor::store(velocity, self.eight_bit, true));
        }
        let delta = grad.mul_scalar(lr);
        (tensor - delta, Some(Sgd8State { velocity: kept }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        Sgd8State {
            velocity: state.velocity.map(|velocity| velocity.to_device(device)),
        }
    }
}

/// Adam (L2 decay added to the gradient) or AdamW (decoupled decay), its moments in 8 bits.
#[derive(Clone, Debug)]
pub struct Adam8 {
    pub(crate) beta_1: f32,
    pub(crate) beta_2: f32,
    pub(crate) epsilon: f32,
    pub(crate) weight_decay: f32,
    /// AdamW's decoupled decay (else Adam's L2 penalty).
    pub(crate) decoupled: bool,
    pub(crate) eight_bit: bool,
}

/// [`Adam8`]'s state of one parameter.
#[derive(Record, Clone)]
pub struct Adam8State<B: Backend, const D: usize> {
    /// Steps taken.
    pub time: usize,
    /// The first moment (signed map).
    pub moment_1: StateTensor<B, D>,
    /// The second moment (unsigned map).
    pub moment_2: StateTensor<B, D>,
}

impl<B: Backend> SimpleOptimizer<B> for Adam8 {
    type State<const D: usize> = Adam8State<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        mut grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        if !self.decoupled && self.weight_decay > 0.0 {
            grad = tensor.clone().mul_scalar(self.weight_decay).add(grad);
        }
        let factor_1 = 1.0 - self.beta_1;
        let factor_2 = 1.0 - self.beta_2;
        let (time, moment_1, moment_2) = match state {
            Some(state) => (
                state.time + 1,
                state
                    .moment_1
                    .load()
                    .mul_scalar(self.beta_1)
                    .add(grad.clone().mul_scalar(factor_1)),
                state
                    .moment_2
                    .load()
                    .mul_scalar(self.beta_2)
                    .add(grad.square().mul_scalar(factor_2)),
            ),
            None => (
                1,
                grad.clone().mul_scalar(factor_1),
                grad.square().mul_scalar(factor_2),
            ),
        };
        let t = time as i32;
        let updated = if self.decoupled {
            let corrected_1 = moment_1.clone().div_scalar(1f32 - self.beta_1.powi(t));
            let corrected_2 = moment_2.clone().div_scalar(1f32 - self.beta_2.powi(t));
            let delta = corrected_1.div(corrected_2.sqrt().add_scalar(self.epsilon));
            let decay_rate = lr * (self.weight_decay as f64);
            let decayed = if decay_rate == 0.0 {
                tensor
            } else {
                tensor.mul_scalar(1.0 - decay_rate)
            };
            decayed - delta.mul_scalar(lr)
        } else {
            let bias_correction_2 = (1.0 - self.beta_2.powi(t)).sqrt();
            let combined = bias_correction_2 / (1.0 - self.beta_1.powi(t));
            let delta = moment_1.clone().mul_scalar(combined).div(
                moment_2
                    .clone()
                    .sqrt()
                    .add_scalar(self.epsilon * bias_correction_2),
            );
            tensor - delta.mul_scalar(lr)
        };
        let state = Adam8State {
            time,
            moment_1: StateTensor::store(moment_1, self.eight_bit, true),
            moment_2: StateTensor::store(moment_2, self.eight_bit, false),
        };
        (updated, Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        Adam8State {
            time: state.time,
            moment_1: state.moment_1.to_device(device),
            moment_2: state.moment_2.to_device(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::optim::decay::WeightDecayConfig;
    use burn::optim::momentum::MomentumConfig;
    use burn::optim::{AdamConfig, AdamWConfig, SgdConfig};
    use burn::tensor::Distribution;

    type K = Flex;

    /// Five steps of `a` and `b` from the same tensor and gradients: the same bits.
    fn same_steps<A: SimpleOptimizer<K>, O: SimpleOptimizer<K>>(a: &A, b: &O) {
        let device = Default::default();
        let mut x = Tensor::<K, 2>::random([8, 16], Distribution::Normal(0.0, 1.0), &device);
        let mut y = x.clone();
        let (mut sa, mut sb) = (None, None);
        for step in 0..5 {
            let grad = Tensor::<K, 2>::random([8, 16], Distribution::Normal(0.0, 1.0), &device);
            let (nx, na) = a.step(0.01, x, grad.clone(), sa);
            let (ny, nb) = b.step(0.01, y, grad, sb);
            assert_eq!(
                nx.to_data().as_bytes(),
                ny.to_data().as_bytes(),
                "step {step}"
            );
            (x, y, sa, sb) = (nx, ny, na, nb);
        }
    }

    #[test]
    fn in_fp32_the_8_bit_optimizers_are_burns_own_bit_for_bit() {
        for (momentum, nesterov, decay) in [(0.9, false, 1e-4), (0.9, true, 0.0), (0.0, false, 0.0)]
        {
            let burn = SgdConfig::new()
                .with_momentum((momentum > 0.0).then_some(MomentumConfig {
                    momentum,
                    dampening: 0.0,
                    nesterov,
                }))
                .with_weight_decay((decay > 0.0).then(|| WeightDecayConfig::new(decay as f32)))
                .build::<K>();
            let ours = Sgd8 {
                momentum,
                dampening: 0.0,
                nesterov,
                weight_decay: (decay > 0.0).then_some(decay as f32),
                eight_bit: false,
            };
            same_steps(&ours, &burn);
        }
        for decay in [0.0, 1e-2] {
            let burn = AdamConfig::new()
                .with_epsilon(1e-8)
                .with_weight_decay((decay > 0.0).then(|| WeightDecayConfig::new(decay)))
                .build();
            let ours = Adam8 {
                beta_1: 0.9,
                beta_2: 0.999,
                epsilon: 1e-8,
                weight_decay: decay,
                decoupled: false,
                eight_bit: false,
            };
            same_steps(&ours, &burn);
            let burn = AdamWConfig::new()
                .with_epsilon(1e-8)
                .with_weight_decay(decay)
                .build();
            let ours = Adam8 {
                decoupled: true,
                ..ours
            };
            same_steps(&ours, &burn);
        }
    }
}
