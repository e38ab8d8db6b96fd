//! The check a user runs on their own model: checkpointing (and, if asked, half precision)
//! changes the gradients by nothing (half: by its rounding) and lowers the memory, measured.
//!
//! It does what memsave's own tests do, in one call:
//! - it materialises every parameter first: Burn initialises lazily, so two clones of a fresh
//!   model would otherwise get different weights, and a with/without comparison would differ
//!   for that reason alone;
//! - it reseeds the backend before each pass, so dropout draws the same masks;
//! - it runs one forward and backward without checkpointing and one with every `#[with_cp]`
//!   segment checkpointed (and the same two in half precision), and compares each parameter's
//!   gradient;
//! - it records which segments ran checkpointed, how often each was recomputed in backward,
//!   and the bytes each kept for backward with and without checkpointing, and reads the step's
//!   peak from the one [`Meter`](crate::memory::Meter) (the counting allocator on the CPU, the
//!   pools on a device).
//!
//! ```ignore
//! let report = memsave::check::check_model(model, |model| model.loss(images.clone(), labels.clone()))?;
//! assert!(report.worst_difference() == 0.0, "{report}");
//! ```

mod passes;
mod report;

pub use report::{CheckReport, PassReport, SegmentReport};

use burn::module::{AutodiffModule, ModuleMapper};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use crate::checkpoint::CheckpointModule;
use crate::fp16::{wrap_fp16_model, Fp16Module, Precision};
use crate::{Error, Result};
use passes::{relative_difference, Passes};

/// What to run: the seed drawn before each pass, and the half precision to compare (with the
/// static loss scale its backward runs at).
#[derive(Clone, Debug)]
pub struct ModelCheck {
    /// Drawn by the backend before each pass (dropout's masks).
    pub seed: u64,
    /// The half precision to compare against fp32, if any.
    pub precision: Option<Precision>,
    /// The loss is multiplied by this before a half backward and the gradients divided back
    /// (MMCV's static 512), so that small f16 gradients do not flush to zero.
    pub loss_scale: f64,
}

impl Default for ModelCheck {
    fn default() -> Self {
        ModelCheck {
            seed: 42,
            precision: None,
            loss_scale: crate::scaler::MMCV_STATIC_SCALE,
        }
    }
}

/// The types in `model` whose `with_cp` flag is on but for which no `#[with_cp]` method has
/// run (a block whose forward is not marked): call it after a forward pass. Each is named once,
/// short (`Block`); [`crate::checkpoint::no_segment_message`] says what to do.
pub fn switched_on_without_segment<M: Fp16Module>(model: &M) -> Vec<String> {
    crate::checkpoint::unreached(|visit| model.visit_with_cp_flags(visit))
}

/// After a step's forward: every module of `model` whose `with_cp` switch is on ran a
/// `#[with_cp]` method in the current run. Where one did not (a block whose forward is not
/// marked), the current run's choice ([`crate::checkpoint::set_unused_with_cp`]) says what
/// happens: an error naming the types (the default), or a warning (an event with the `types`,
/// said once per run), whose text it returns. The runner, burn-train's adapter and [`ModelCheck`]
/// call it after the first step; in a user's own loop, call it after the first backward.
pub fn segments_ran<M: Fp16Module>(model: &M) -> Result<Option<String>> {
    let missing = switched_on_without_segment(model);
    if missing.is_empty() {
        return Ok(None);
    }
    let message = crate::checkpoint::no_segment_message(&missing);
    match crate::checkpoint::unused_with_cp() {
        crate::checkpoint::UnusedWithCp::Error => Err(Error::invalid("with_cp", message)),
        crate::checkpoint::UnusedWithCp::Warn => {
            // Said once per run; each caller (a data-parallel peer's runner among them) keeps it.
            if crate::run::current().first_time("unused with_cp") {
                tracing::warn!(target: "memsave", types = ?missing, "{message}");
            }
            Ok(Some(message))
        }
    }
}

/// [`ModelCheck::run`] with the defaults (fp32 only, seed 42).
pub fn check_model<B, M, L>(model: M, loss: L) -> Result<CheckReport>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + CheckpointModule,
    L: Fn(&M) -> Tensor<B, 1>,
{
    ModelCheck::default().run(model, loss)
}

impl ModelCheck {
    /// Also compares half precision (`Precision::F16` or `Bf16`) with and without
    /// checkpointing, and against fp32.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = Some(precision);
        self
    }

    /// Runs the fp32 passes (see the module's text); `loss` computes the mean loss of the
    /// user's batch from a model.
    pub fn run<B, M, L>(&self, model: M, loss: L) -> Result<CheckReport>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + CheckpointModule,
        L: Fn(&M) -> Tensor<B, 1>,
    {
        if self.precision.is_some() {
            return Err(Error::invalid(
                "precision",
                "comparing half precision needs a model that can be wrapped for it: call \
                 `ModelCheck::run_with_fp16` (the model must implement `Fp16Module`, as \
                 #[memsave::model] makes it)",
            ));
        }
        // In the run of this thread (installed, or its own): its choices and counts.
        crate::run::current().scope(|| {
            let model = materialise(model);
            let mut runner = Passes::new(self, &model);
            runner.pair("fp32", &model, &loss, 1.0)?;
            runner.report()
        })?
    }

    /// [`ModelCheck::run`], with the half passes of [`ModelCheck::with_precision`] (F16 if it
    /// was not called).
    pub fn run_with_fp16<B, M, L>(&self, model: M, loss: L) -> Result<CheckReport>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + CheckpointModule + Fp16Module,
        L: Fn(&M) -> Tensor<B, 1>,
    {
        if !(self.loss_scale.is_finite() && self.loss_scale > 0.0) {
            return Err(Error::invalid(
                "loss_scale",
                format!("must be a positive finite number, got {}", self.loss_scale),
            ));
        }
        crate::run::current().scope(|| self.run_with_fp16_here(model, loss))?
    }

    fn run_with_fp16_here<B, M, L>(&self, model: M, loss: L) -> Result<CheckReport>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + CheckpointModule + Fp16Module,
        L: Fn(&M) -> Tensor<B, 1>,
    {
        let precision = self.precision.unwrap_or(Precision::F16);
        let model = materialise(model);
        let mut runner = Passes::new(self, &model);
        runner.pair("fp32", &model, &loss, 1.0)?;
        let half = wrap_fp16_model(model, precision);
        let name = match precision {
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        };
        runner.pair(name, &half, &loss, self.loss_scale)?;
        let reference = runner.passes[0].0.name.clone();
        let gradients = runner.passes[0].1.clone();
        let (difference, worst) = relative_difference(&runner.passes[2].1, &gradients);
        let (plain_half, _) = &mut runner.passes[2];
        plain_half.difference = difference;
        plain_half.worst_parameter =
            worst.map(|id| runner.names.get(&id).cloned().unwrap_or_default());
        plain_half.against = reference;
        runner.report()
    }
}

/// Initialises every lazy parameter, so that clones share their values. Burn initialises a
/// fresh model's weights on first use, and each clone of a fresh model draws its own: compare
/// two runs (with and without a strategy) from `materialise(model)` and its clones.
pub fn materialise<B: Backend, M: Module<B>>(model: M) -> M {
    struct Materialise;
    impl<B: Backend> ModuleMapper<B> for Materialise {}
    model.map(&mut Materialise)
}
