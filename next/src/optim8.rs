//! SGD with momentum, Adam and AdamW keeping their state in 8 bits ([`crate::quant`]) on
//! burn-optim 0.22: the momentum buffer and the first moment signed, Adam's second moment
//! unsigned. Each is a per-tensor `Optimizer` (0.22's name for 0.21's `SimpleOptimizer`), so
//! `init()` gives Burn's `ModuleOptimizer`, used as Burn's own optimizers are. Each step
//! dequantizes the parameter's state, updates it in fp32 with the operations of
//! `burn::optim::{Sgd, Adam, AdamW}` in the same order (with the state kept in fp32, as it is for
//! tensors under [`crate::quant::MIN_ELEMENTS`] values, the same bits), and quantizes it again.
//! Nesterov momentum asks for zero dampening (PyTorch's rule; Burn's default dampening is 0.1).
//!
//! Their state is not Burn's: a record of Burn's own `Adam`, `AdamW` or `Sgd` does not load into
//! them (or back), and Burn's `ModuleOptimizer::load_record` drops a state it cannot read without
//! an error (Adam would start again at step 1). Switch optimizers between runs, not within one.
//!
//! ```
//! use memsave_next::optim8::Adam8;
//!
//! // Burn's `AdamWConfig::new().init()`, its moments in 8 bits:
//! let optimizer = Adam8::adamw().init().expect("valid settings");
//! // A wrong setting is an error naming it:
//! let Err(error) = Adam8::adam().with_betas(0.9, 1.5).init() else {
//!     panic!("beta_2 = 1.5 is refused");
//! };
//! assert!(error.to_string().contains("beta_2"), "{error}");
//! ```

use burn::optim::{join_path, LearningRate, ModuleOptimizer, Optimizer, RecordState};
use burn::optim::{StateSink, StateSource};
use burn::tensor::{Device, Tensor};

use crate::quant::StateTensor;
use crate::{Error, Result};

/// SGD (PyTorch's, Burn's) with its momentum buffer in 8 bits.
#[derive(Clone, Debug)]
pub struct Sgd8 {
    momentum: f64,
    dampening: f64,
    nesterov: bool,
    /// L2 penalty added to the gradient.
    weight_decay: Option<f32>,
    eight_bit: bool,
}

impl Default for Sgd8 {
    fn default() -> Self {
        Self::new()
    }
}

impl Sgd8 {
    /// Plain SGD (Burn's `SgdConfig::new()`): no momentum, so no state to keep.
    pub fn new() -> Self {
        Sgd8 {
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: None,
            eight_bit: true,
        }
    }

    /// With momentum (Burn's `MomentumConfig`: its defaults are 0.9, 0.1, false).
    pub fn with_momentum(mut self, momentum: f64, dampening: f64, nesterov: bool) -> Self {
        (self.momentum, self.dampening, self.nesterov) = (momentum, dampening, nesterov);
        self
    }

    /// With an L2 penalty added to the gradient (Burn's `WeightDecayConfig`).
    pub fn with_weight_decay(mut self, penalty: f32) -> Self {
        self.weight_decay = Some(penalty);
        self
    }

    /// Whether large buffers are kept in 8 bits (on by default; off: Burn's SGD, bit for bit).
    pub fn with_eight_bit(mut self, eight_bit: bool) -> Self {
        self.eight_bit = eight_bit;
        self
    }

    /// Burn's optimizer over a module, after checking the settings (an error names the one at
    /// fault).
    pub fn init(self) -> Result<ModuleOptimizer> {
        self.validate()?;
        Ok(ModuleOptimizer::from(self))
    }

    /// Checks the settings (an error names the one at fault): what [`Sgd8::init`] does before
    /// it makes the module optimizer, for a caller that wraps the rule first.
    pub fn validate(&self) -> Result<()> {
        in_range("momentum", self.momentum, 0.0, 1.0, false)?;
        in_range("dampening", self.dampening, 0.0, 1.0, true)?;
        if let Some(penalty) = self.weight_decay {
            in_range("weight_decay", penalty as f64, 0.0, f64::INFINITY, false)?;
        }
        if self.momentum == 0.0 && self.dampening != 0.0 {
            return Err(Error::invalid(
                "dampening",
                "needs a momentum (without one there is no velocity to dampen)",
            ));
        }
        if self.nesterov && (self.momentum == 0.0 || self.dampening != 0.0) {
            return Err(Error::invalid(
                "nesterov",
                "needs a momentum and zero dampening (PyTorch's rule)",
            ));
        }
        Ok(())
    }
}

/// [`Sgd8`]'s state of one parameter.
#[derive(Clone)]
pub struct Sgd8State<const D: usize> {
    /// The momentum buffer (none without momentum).
    pub velocity: Option<StateTensor<D>>,
}

// `Sgd8` and `Adam8` repeat Burn's `Optimizer::step` signature, as each impl must; their
// bodies (the two rules) share nothing.
impl Optimizer for Sgd8 {
    type State<const D: usize> = Sgd8State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        mut grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
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

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        Sgd8State {
            velocity: state.velocity.map(|velocity| velocity.to_device(device)),
        }
    }
}

impl<const D: usize> RecordState for Sgd8State<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        if let Some(velocity) = &self.velocity {
            velocity.state_flatten(&join_path(prefix, "velocity"), out);
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let at = join_path(prefix, "velocity");
        let velocity = if src.has_under(&at) {
            Some(StateTensor::state_unflatten(&at, src, device)?)
        } else {
            None
        };
        Some(Sgd8State { velocity })
    }
}

/// Adam (L2 decay added to the gradient) or AdamW (decoupled decay), its moments in 8 bits.
#[derive(Clone, Debug)]
pub struct Adam8 {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// AdamW's decoupled decay (else Adam's L2 penalty).
    decoupled: bool,
    eight_bit: bool,
}

impl Adam8 {
    /// Adam with Burn's defaults (`AdamConfig::new()`: betas 0.9 and 0.999, epsilon 1e-5, no
    /// weight decay).
    pub fn adam() -> Self {
        Adam8 {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 0.0,
            decoupled: false,
            eight_bit: true,
        }
    }

    /// AdamW with Burn's defaults (`AdamWConfig::new()`: Adam's, and a decoupled weight decay of
    /// 1e-4).
    pub fn adamw() -> Self {
        Adam8 {
            weight_decay: 1e-4,
            decoupled: true,
            ..Adam8::adam()
        }
    }

    /// With these betas.
    pub fn with_betas(mut self, beta_1: f32, beta_2: f32) -> Self {
        (self.beta_1, self.beta_2) = (beta_1, beta_2);
        self
    }

    /// With this epsilon.
    pub fn with_epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// With this weight decay: Adam's L2 penalty, or AdamW's decoupled decay.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Whether large moments are kept in 8 bits (on by default; off: Burn's Adam or AdamW, bit
    /// for bit).
    pub fn with_eight_bit(mut self, eight_bit: bool) -> Self {
        self.eight_bit = eight_bit;
        self
    }

    /// Burn's optimizer over a module, after checking the settings (an error names the one at
    /// fault).
    pub fn init(self) -> Result<ModuleOptimizer> {
        self.validate()?;
        Ok(ModuleOptimizer::from(self))
    }

    /// Checks the settings (an error names the one at fault): what [`Adam8::init`] does before
    /// it makes the module optimizer, for a caller that wraps the rule first.
    pub fn validate(&self) -> Result<()> {
        in_range("beta_1", self.beta_1 as f64, 0.0, 1.0, false)?;
        in_range("beta_2", self.beta_2 as f64, 0.0, 1.0, false)?;
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(Error::invalid(
                "epsilon",
                format!("must be a positive number, got {}", self.epsilon),
            ));
        }
        in_range(
            "weight_decay",
            self.weight_decay as f64,
            0.0,
            f64::INFINITY,
            false,
        )?;
        Ok(())
    }
}

/// `value` in `[low, high)` (or `[low, high]` when `inclusive`), else an error naming `field`.
fn in_range(field: &str, value: f64, low: f64, high: f64, inclusive: bool) -> Result<()> {
    let below_high = if inclusive {
        value <= high
    } else {
        value < high
    };
    if value >= low && below_high {
        return Ok(());
    }
    let close = if inclusive { "]" } else { ")" };
    Err(Error::invalid(
        field,
        format!("must be in [{low}, {high}{close}, got {value}"),
    ))
}

/// [`Adam8`]'s state of one parameter.
#[derive(Clone)]
pub struct Adam8State<const D: usize> {
    /// Steps taken.
    pub time: usize,
    /// The first moment (signed map).
    pub moment_1: StateTensor<D>,
    /// The second moment (unsigned map).
    pub moment_2: StateTensor<D>,
}

impl Optimizer for Adam8 {
    type State<const D: usize> = Adam8State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        mut grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
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
        // Burn's Adam (`AdaptiveMomentum`) and AdamW (`AdaptiveMomentumW`) correct the moments
        // in different orders: each is followed to the letter.
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

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        Adam8State {
            time: state.time,
            moment_1: state.moment_1.to_device(device),
            moment_2: state.moment_2.to_device(device),
        }
    }
}

impl<const D: usize> RecordState for Adam8State<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "time", (self.time as u64).into());
        self.moment_1
            .state_flatten(&join_path(prefix, "moment_1"), out);
        self.moment_2
            .state_flatten(&join_path(prefix, "moment_2"), out);
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let time = u64::try_from(src.take_scalar(prefix, "time")?).ok()? as usize;
        let moment_1 = StateTensor::state_unflatten(&join_path(prefix, "moment_1"), src, device)?;
        let moment_2 = StateTensor::state_unflatten(&join_path(prefix, "moment_2"), src, device)?;
        Some(Adam8State {
            time,
            moment_1,
            moment_2,
        })
    }
}
