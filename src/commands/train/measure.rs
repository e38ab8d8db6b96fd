//! The measuring job of `memsave plan`: timed, metered and profiled steps.

use burn::tensor::backend::AutodiffBackend;
use memsave::checkpoint::CheckpointModule;
use memsave::config::{Config, ConfigHooks, LossScaleSpec};
use memsave::planner::{ProfileHook, StepMeter};
use memsave::train::{DataSource, Runner, TrainModel};

use super::Measurement;

/// Bytes copied each way to price the link between the device and host memory.
const LINK_PROBE_BYTES: usize = 32 << 20;

/// `warmup` steps, `iters` measured ones and a profiled one of `model` on `data`; the
/// [`Measurement`] reported to the parent.
pub(super) fn measure<B, S, D, M, Data>(
    config: &Config<S, D>,
    model: M,
    data: Data,
    (warmup, iters, checkpoint_all): (usize, usize, bool),
    device: B::Device,
) -> memsave::Result<()>
where
    B: AutodiffBackend + memsave::Backend,
    M: TrainModel<B> + CheckpointModule,
    Data: DataSource<B, M::Batch> + 'static,
{
    let probe = || {
        memsave::memory::meter_for(&device).ok_or_else(|| {
            memsave::Error::invalid("--device", "the memory of this device cannot be read")
        })
    };
    let (parameters, trainable) = memsave::train::params::param_bytes::<B, M>(&model);
    let work_dir = std::env::temp_dir().join(format!("memsave-plan-{}", std::process::id()));
    // Whole optimizer steps: under accumulation a warm-up step is a whole group (the optimizer
    // state exists from the first step on), each measured step a group's micro-batches, and the
    // profiled micro-batch a group's last (the sums live, the step taken).
    let micro = config
        .optimizer_config
        .groups()
        .map_or(1, |groups| groups.cumulative_iters());
    let (warmup, iters) = (warmup * micro, iters * micro);
    // The measured steps must be steps the optimizer takes. A dynamic loss scale starts high
    // (65536; MMCV's 2^32) and skips its first steps on overflow: such a step has no update
    // and, with the step in backward, no second pass, so it would be measured cheaper than the
    // steps that follow. Measure at MMCV's static scale instead (the same memory and time for
    // a step taken).
    let mut hook = config.optimizer_hook_of()?;
    let mut scale = config.fp16.as_ref().map(|fp16| fp16.loss_scale.clone());
    if let Some(fp16) = &config.fp16 {
        if !matches!(fp16.loss_scale, LossScaleSpec::Static(_)) {
            let spec = LossScaleSpec::Static(memsave::scaler::MMCV_STATIC_SCALE);
            hook = hook.with_mixed_precision(spec.scaler()?, fp16.precision);
            scale = Some(spec);
        }
    }
    let mut runner = Runner::new(
        model,
        config.optimizer(),
        Box::new(hook),
        data,
        memsave::train::RunLength::Iters(warmup + iters + micro),
        &work_dir,
        device.clone(),
    )?;
    runner.register_hook_at(
        Box::new(memsave::hooks::LrUpdaterHook::new(config.lr_schedule())?),
        memsave::train::Priority::VeryHigh,
    );
    // CPU staging: the link priced first (before the run's tensors fill the device), then
    // activation offload switched on as training does (the profile counts the bytes it copies
    // and the host's step time).
    let stages = config.offload.activations || config.offload.optimizer;
    let link = if stages {
        memsave::checkpoint::measure_link::<B::InnerBackend>(&device, LINK_PROBE_BYTES)
    } else {
        None
    };
    if let Some(offload) = config.offload.activations() {
        runner.register_hook(Box::new(memsave::hooks::OffloadHook::new(offload)));
    }
    let meter = StepMeter::new(warmup, warmup + iters, probe()?);
    let steps = meter.steps.clone();
    let mut profiler = ProfileHook::new(warmup + iters + micro - 1, probe()?);
    profiler.checkpoint_all = checkpoint_all;
    let profile = profiler.profile.clone();
    runner.register_hook(Box::new(meter));
    runner.register_hook(Box::new(profiler));
    let copies = runner.state().optimizer_state_per_weight;
    runner.run()?;
    let _ = std::fs::remove_dir_all(&work_dir);
    let profile = profile.take().ok_or_else(|| match scale {
        Some(LossScaleSpec::Static(scale)) if runner.state().log.overflow => {
            memsave::Error::Data(format!(
                "the profiled step's gradients overflowed (inf or NaN) at the static loss \
                 scale {scale}, so the step was skipped and cannot be measured; set a smaller \
                 `fp16.loss_scale`"
            ))
        }
        _ => memsave::Error::Data("the profiled step did not run".into()),
    })?;
    let mut profile = profile;
    profile.link_bytes_per_second = link.map_or(0.0, |link| link.slower());
    let measurement = Measurement {
        steps: steps.take(),
        profile,
        parameters,
        trainable,
        optimizer_state_per_weight: copies,
    };
    crate::commands::worker::send(&crate::commands::worker::Report::Done(measurement))
}
