//! `memsave test CONFIG CHECKPOINT [--out DETS.json]`: a trained detector on its config's test
//! split; writes the detections (the devkit's pixels) and prints the VOC mAP table.

use std::path::PathBuf;

use memsave::config::Config;
use memsave::models::config::{DetectionDataSection, RetinaNetSection};
use memsave::models::data::voc::loader::VocDetection;
use memsave::models::eval::hook::evaluate;
use memsave::models::eval::voc::{write_detections, ApMode};
use memsave::train::load_weights;

use super::Device;

#[derive(clap::Args, Debug)]
pub struct TestArgs {
    /// The config the detector was trained with.
    config: PathBuf,
    /// A checkpoint written by `memsave train`.
    checkpoint: PathBuf,
    /// Where to write the detections (JSON, `memsave data voc-map`'s input).
    #[arg(long)]
    out: Option<PathBuf>,
    /// `11points` (VOC2007) or `area`; default: 11points for a VOC2007 split, else area.
    #[arg(long)]
    metric: Option<ApMode>,
    /// Override a config key, as TOML.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
}

pub fn test(args: TestArgs) -> memsave::Result<()> {
    crate::on_backend!(args.device, K => test_on::<K>(&args, Default::default()))
}

fn test_on<B: memsave::Backend>(args: &TestArgs, device: B::Device) -> memsave::Result<()> {
    if !memsave::models::registry::entry(&args.config, &args.set)?.detector {
        return Err(memsave::Error::invalid(
            "model.type",
            "`memsave test` runs a detector: the config's model is not a RetinaNet",
        ));
    }
    let config = Config::<RetinaNetSection, DetectionDataSection>::load(&args.config, &args.set)?;
    let model = config
        .model
        .retinanet()?
        .init::<B>(&device)
        .map_err(|e| e.within("model"))?;
    let model = load_weights(model, &args.checkpoint, &device)?;
    let split = &config.data.test;
    let data = VocDetection::<B>::new(
        split,
        "data.test",
        false,
        config.data.samples_per_gpu,
        config.data.workers_per_gpu,
        0,
        device,
    )?;
    let mode = args.metric.unwrap_or(if split.is_voc2007() {
        ApMode::ElevenPoints
    } else {
        ApMode::Area
    });
    let (records, result) = evaluate(&model, &data, mode)?;
    if let Some(out) = &args.out {
        write_detections(out, &records)?;
        eprintln!(
            "memsave: {} detections written to {}",
            records.len(),
            out.display()
        );
    }
    println!("{result}");
    Ok(())
}
