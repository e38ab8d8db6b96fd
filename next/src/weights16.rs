//! Parameter compression on burn-optim 0.22: the trainable weights kept in 16 bits as their only
//! copy. [`Weights16`] wraps any per-tensor `Optimizer` of Burn's (or memsave's 8-bit ones): each
//! parameter is widened to fp32 for its own step, stepped by the wrapped optimizer's rule in fp32,
//! and rounded back to its 16-bit type: stochastically (the default; torchao's
//! `bf16_stochastic_round`), to nearest, or with a 16-bit Kahan compensation per weight
//! ("Revisiting BFloat16 Training", Zamirai et al. 2020). The forward runs on the 16-bit weights
//! themselves (`wrap_fp16_model` makes them so); a parameter kept in fp32 (an fp32 island's) is
//! stepped as the wrapped optimizer steps it.
//!
//! The stochastic draws are counter-based ([`memsave_common::draws`]): a parameter's stream is a
//! function of the seed, the parameter's number (the order in which parameters were first
//! stepped, Burn's module order when each has a gradient at the first step) and its step count,
//! both kept in its state, so a resumed optimizer draws the same numbers; a resumed optimizer
//! numbers a parameter first stepped after the resume past every number it restored. Use one
//! `Weights16` per run (its clones share the numbering: clone it for `ModuleOptimizer::with_group`
//! rather than making another). The rounding goes a slice of 2^18 values at a time, so that its
//! temporaries stay about a MiB whatever the parameter's size.
//!
//! Its state is not Burn's: a record of Burn's own optimizer does not load into a `Weights16`
//! (or back), and Burn's `ModuleOptimizer::load_record` drops a state it cannot read without an
//! error. Switch optimizers between runs, not within one.
//!
//! ```
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::{AdamWConfig, GradientsParams};
//! use burn::prelude::*;
//! use burn::tensor::DType;
//! use memsave_next::fp16::{wrap_fp16_model, Precision};
//! use memsave_next::weights16::Weights16;
//!
//! let device = Device::flex().autodiff();
//! let model: Linear = LinearConfig::new(4, 2).init(&device);
//! let mut model = wrap_fp16_model(model, Precision::Bf16); // the weights, in bf16 only
//! let mut optimizer = Weights16::new(AdamWConfig::new().build()).init();
//! for _ in 0..3 {
//!     let x = Tensor::<2>::ones([8, 4], &device).cast(DType::BF16);
//!     let loss = model.forward(x).cast(DType::F32).powi_scalar(2).mean();
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     model = optimizer.step(1e-3, model, grads);
//! }
//! assert_eq!(model.weight.val().dtype(), DType::BF16);
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::optim::{join_path, LearningRate, ModuleOptimizer, Optimizer, RecordState};
use burn::optim::{StateSink, StateSource};
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use memsave_common::draws::{splitmix64, uniforms};

pub use memsave_common::weights::{StepRounding, WeightRounding};

/// `inner`'s rule on 16-bit weights (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct Weights16<O> {
    inner: O,
    rounding: WeightRounding,
    seed: u64,
    /// Parameters stepped so far: the next one's stream.
    streams: Arc<AtomicU64>,
}

impl<O: Optimizer> Weights16<O> {
    /// `inner` (a per-tensor optimizer: `AdamWConfig::build()`, memsave's `Adam8`), rounding
    /// stochastically with seed 0.
    pub fn new(inner: O) -> Self {
        Weights16 {
            inner,
            rounding: WeightRounding::Stochastic,
            seed: 0,
            streams: Arc::new(AtomicU64::new(0)),
        }
    }

    /// With another rounding.
    pub fn with_rounding(mut self, rounding: WeightRounding) -> Self {
        self.rounding = rounding;
        self
    }

    /// With the stochastic draws seeded by `seed`.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Burn's optimizer over a module.
    pub fn init(self) -> ModuleOptimizer {
        ModuleOptimizer::from(self)
    }
}

/// [`Weights16`]'s state of one parameter.
#[derive(Clone)]
pub struct Weights16State<S, const D: usize> {
    /// The wrapped optimizer's state.
    pub inner: Option<S>,
    /// Steps taken.
    pub steps: u64,
    /// The parameter's number: its stream of draws.
    pub stream: u64,
    /// Kahan's compensation, in the weight's type.
    pub carry: Option<Tensor<D>>,
}

impl<O: Optimizer> Optimizer for Weights16<O> {
    type State<const D: usize> = Weights16State<O::State<D>, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let (inner, steps, stream, carry) = match state {
            Some(state) => {
                // A resumed optimizer numbers new parameters past the numbers it restored.
                self.streams.fetch_max(state.stream + 1, Ordering::Relaxed);
                (state.inner, state.steps, state.stream, state.carry)
            }
            None => (None, 0, self.streams.fetch_add(1, Ordering::Relaxed), None),
        };
        let dtype = tensor.dtype();
        if !matches!(dtype, DType::BF16 | DType::F16) {
            // Not compressed (an fp32 island): the wrapped rule, as it is.
            let (stepped, inner) = self.inner.step(lr, tensor, grad, inner);
            let state = Weights16State {
                inner,
                steps: steps + 1,
                stream,
                carry: None,
            };
            return (stepped, Some(state));
        }
        let counting = counting();
        let before = counting.then(|| tensor.clone());
        let old = tensor.cast(DType::F32);
        let (new, inner) = self
            .inner
            .step(lr, old.clone(), grad.cast(DType::F32), inner);
        // The values the rule moved, where a reader asked for the counts (`take_step_rounding`).
        let moved = before.map(|before| (new.clone().not_equal(old.clone()), before));
        let (stored, carry) = match self.rounding {
            WeightRounding::Nearest => (nearest(new, dtype), None),
            WeightRounding::Stochastic => {
                let key = splitmix64(self.seed ^ splitmix64(stream ^ splitmix64(steps)));
                (stochastic_in_slices(new, key, dtype), None)
            }
            WeightRounding::Kahan => {
                let carry = match carry {
                    Some(carry) => carry.cast(DType::F32),
                    None => old.zeros_like(),
                };
                let (stored, carry) = kahan(old.clone(), new, carry, dtype);
                (stored, Some(carry.cast(dtype)))
            }
        };
        if let Some((moved, before)) = moved {
            count_rounding(moved, before, &stored, self.rounding);
        }
        let state = Weights16State {
            inner,
            steps: steps + 1,
            stream,
            carry,
        };
        (stored.cast(dtype), Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        Weights16State {
            inner: state.inner.map(|inner| O::to_device(inner, device)),
            steps: state.steps,
            stream: state.stream,
            carry: state.carry.map(|carry| carry.to_device(device)),
        }
    }
}

impl<S: RecordState, const D: usize> RecordState for Weights16State<S, D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "steps", self.steps.into());
        out.push_scalar(prefix, "stream", self.stream.into());
        if let Some(inner) = &self.inner {
            inner.state_flatten(&join_path(prefix, "inner"), out);
        }
        if let Some(carry) = &self.carry {
            out.push_tensor(prefix, "carry", carry.clone().into_data());
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let steps = u64::try_from(src.take_scalar(prefix, "steps")?).ok()?;
        let stream = u64::try_from(src.take_scalar(prefix, "stream")?).ok()?;
        let at = join_path(prefix, "inner");
        let inner = if src.has_under(&at) {
            Some(S::state_unflatten(&at, src, device)?)
        } else {
            None
        };
        let carry = match src.take_tensor(prefix, "carry") {
            Some(data) if data.shape().len() == D => {
                let dtype = data.dtype();
                Some(Tensor::from_data(data, (device, dtype)))
            }
            Some(_) => return None,
            None => None,
        };
        Some(Weights16State {
            inner,
            steps,
            stream,
            carry,
        })
    }
}

/// The counts of the steps since the last [`take_step_rounding`] in a run: values whose fp32
/// update was not zero, and those of them whose stored weight did not change (on the device
/// until read).
#[derive(Default)]
struct RoundingCounts {
    /// Whether a reader asked for the counts ([`count_step_rounding`]).
    asked: AtomicBool,
    counted: Mutex<Option<Counted>>,
}

/// Whether the current run counts the rounding of the 16-bit weights.
fn counting() -> bool {
    crate::run::current()
        .part::<RoundingCounts>()
        .asked
        .load(Ordering::Relaxed)
}

/// Has [`Weights16`] count, in the current run, the updates each step leaves unchanged (read
/// with [`take_step_rounding`]): the optimizer hook and burn-train's adapter ask for it where
/// the weights are kept in 16 bits. It costs two masks and two sums of each parameter's size a
/// step. Returns the previous setting.
pub fn count_step_rounding(on: bool) -> bool {
    crate::run::current()
        .part::<RoundingCounts>()
        .asked
        .swap(on, Ordering::Relaxed)
}

/// The counts so far and the rounding that made them.
struct Counted {
    moved: Tensor<1, Int>,
    unchanged: Tensor<1, Int>,
    rounding: WeightRounding,
}

/// Counts one parameter's step: `moved` where the wrapped rule changed its fp32 value, `before`
/// its 16-bit weight before the step, `stored` what it became (its values are the 16-bit
/// type's). The counts are summed in i64 (a model past 2^31 values counts right).
fn count_rounding<const D: usize>(
    moved: Tensor<D, Bool>,
    before: Tensor<D>,
    stored: &Tensor<D>,
    rounding: WeightRounding,
) {
    let kept = stored.clone().cast(before.dtype()).equal(before);
    let count = |mask: Tensor<D, Bool>| mask.int().cast(DType::I64).sum();
    let unchanged = count(moved.clone().bool_and(kept));
    let moved = count(moved);
    let part = crate::run::current().part::<RoundingCounts>();
    let mut counts = part
        .counted
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    *counts = Some(match counts.take() {
        Some(counted) => {
            let device = counted.moved.device();
            Counted {
                moved: counted.moved + moved.to_device(&device),
                unchanged: counted.unchanged + unchanged.to_device(&device),
                rounding,
            }
        }
        None => Counted {
            moved,
            unchanged,
            rounding,
        },
    });
}

/// How the updates of the 16-bit weights stepped by [`Weights16`] in the current run since the
/// last call were rounded: how many moved their value in fp32, and how many of those left the
/// stored 16-bit weight where it was (rounding to nearest: lost; stochastic: not drawn this
/// time; Kahan: kept in the compensation), and with which rounding. `None` where none was
/// stepped. The optimizer hook and burn-train's adapter read it after each step (the log's
/// `weights_unchanged`).
pub fn take_step_rounding() -> Option<(StepRounding, WeightRounding)> {
    let part = crate::run::current().part::<RoundingCounts>();
    let taken = part
        .counted
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take();
    let counted = taken?;
    // One read of both counts.
    let both = Tensor::cat(vec![counted.moved, counted.unchanged], 0).into_data();
    let both = both
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap_or_default();
    let figures = StepRounding {
        moved: both.first().copied().unwrap_or(0) as f64,
        unchanged: both.get(1).copied().unwrap_or(0) as f64,
    };
    Some((figures, counted.rounding))
}

/// After a step of 16-bit weights kept in `precision`: [`take_step_rounding`]'s share of
/// unchanged weights, and, at the run's first counted step (`counted`: whether one was, set
/// here), the warning f16 weights that lose updates give.
pub(crate) fn step_figures(
    precision: crate::fp16::Precision,
    counted: &mut bool,
) -> Option<(f64, Option<String>)> {
    let (figures, rounding) = take_step_rounding()?;
    let first = !std::mem::replace(counted, true);
    let dtype = match precision {
        crate::fp16::Precision::F16 => memsave_common::weights::WeightDtype::F16,
        crate::fp16::Precision::Bf16 => memsave_common::weights::WeightDtype::Bf16,
    };
    let warning = figures
        .first_step_warning(dtype, rounding)
        .filter(|_| first);
    Some((figures.fraction(), warning))
}

/// Values rounded at once: bounds the rounding's temporaries (the draws and about eight fp32
/// tensors of the slice's size) to a few MiB.
const SLICE: usize = 1 << 18;

/// [`stochastic`] on `new` with the draws of stream `key`, a slice of [`SLICE`] values at a
/// time (value `i` takes draw `i` of the stream, whatever the slicing), returned in `dtype`.
fn stochastic_in_slices<const D: usize>(new: Tensor<D>, key: u64, dtype: DType) -> Tensor<D> {
    let shape = new.shape();
    let n = shape.num_elements();
    let device = new.device();
    let flat: Tensor<1> = new.reshape([n]);
    let mut parts = Vec::with_capacity(n.div_ceil(SLICE));
    for start in (0..n).step_by(SLICE) {
        let len = SLICE.min(n - start);
        let part = flat.clone().slice([start..start + len]);
        let draws = TensorData::new(uniforms(key, start, len), [len]);
        let u = Tensor::<1>::from_data(draws, (&device, DType::F32));
        // Each slice in the weight's type: what is kept of it until the whole is joined.
        parts.push(stochastic(part, u, dtype).cast(dtype));
    }
    let joined = if parts.len() == 1 {
        parts.pop().expect("one slice")
    } else {
        Tensor::cat(parts, 0)
    };
    // In the weight's type: the caller's cast to it is then no work.
    joined.reshape(shape)
}

/// The two constants of a 16-bit type: 0.7 times 2 to the minus its mantissa bits, and 0.7 times
/// its smallest subnormal.
fn moves(dtype: DType) -> (f32, f32) {
    match dtype {
        // bf16: 7 mantissa bits, smallest subnormal 2^-133.
        DType::BF16 => (0.7 / 128.0, 0.7 * (2f32).powi(-133)),
        // f16: 10 mantissa bits, smallest subnormal 2^-24.
        _ => (0.7 / 1024.0, 0.7 * (2f32).powi(-24)),
    }
}

/// `x` (fp32) rounded to nearest in `dtype`, back in fp32.
pub fn nearest<const D: usize>(x: Tensor<D>, dtype: DType) -> Tensor<D> {
    x.cast(dtype).cast(DType::F32)
}

/// `x` (fp32) rounded stochastically to `dtype` with the uniform draws `u` (in `[0, 1)`, one per
/// value): to the neighbour farther away with probability `distance to the nearer / spacing`, so
/// that the expected result is `x` itself. Returned in fp32 (its values are `dtype`'s).
///
/// With tensor operations only: the two neighbours are found with casts. `r` is the value
/// rounded to nearest and `d` what that lost; moving `r` by 0.7 of the spacing at `r`'s own
/// binade towards `d` and rounding to nearest lands on the other neighbour in every case (inside
/// a binade the move is 0.7 to 1.4 spacings; down from a power of two, where the spacing below is
/// half as large, 1.4 of those; below the smallest normal the spacing is the smallest subnormal,
/// which the move is never less than).
pub fn stochastic<const D: usize>(x: Tensor<D>, u: Tensor<D>, dtype: DType) -> Tensor<D> {
    let (fraction, smallest) = moves(dtype);
    let r = nearest(x.clone(), dtype);
    let d = x.sub(r.clone());
    let step = r
        .clone()
        .abs()
        .mul_scalar(fraction)
        .clamp_min(smallest)
        .mul(d.clone().sign());
    let other = nearest(r.clone().add(step), dtype);
    let spacing = other.clone().sub(r.clone()).abs();
    // Where `d` is 0 the other neighbour is `r` itself and the probability 0.
    let p = d.abs().div(spacing.clamp_min(f32::from_bits(1)));
    let farther: Tensor<D, Bool> = u.lower(p);
    r.mask_where(farther, other)
}

/// Kahan-compensated update of a 16-bit weight: `old` (fp32, the stored value), `new` (fp32, the
/// optimizer's result) and the compensation `carry` (fp32) so far. Returns the new stored value
/// (rounded to nearest, in fp32) and the new compensation: what the rounding lost of the update
/// and the carry, added to the next update.
pub fn kahan<const D: usize>(
    old: Tensor<D>,
    new: Tensor<D>,
    carry: Tensor<D>,
    dtype: DType,
) -> (Tensor<D>, Tensor<D>) {
    let update = new.sub(old.clone()).add(carry);
    let stored = nearest(old.clone().add(update.clone()), dtype);
    let carry = update.sub(stored.clone().sub(old));
    (stored, carry)
}
