//! `memsave data synth-voc DIR` and `memsave data voc-map ROOT --split NAME --detections FILE`.

use std::path::{Path, PathBuf};

use clap::Subcommand;
use memsave::models::data::voc::read_split;
use memsave::models::data::voc::synth::write_synthetic_voc;
use memsave::models::eval::voc::{read_detections, voc_map, ApMode};

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Write a small synthetic data set in Pascal VOC's format to DIR/VOC2007 (JPEG images,
    /// the devkit's XML, `trainval.txt` and `test.txt`), the same for the same seed.
    SynthVoc {
        /// The folder to create `VOC2007` in.
        dir: PathBuf,
        /// Images in all (every fourth is a test image).
        #[arg(long, default_value_t = 200)]
        images: usize,
        /// The seed of the drawing.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Score a detections file on a VOC split: one line per class, then `mAP: <value>`.
    VocMap {
        /// The devkit folder of the split (`VOCdevkit/VOC2007`), or the folder holding
        /// `VOC2007`.
        root: PathBuf,
        /// The split list's name (`test` for `ImageSets/Main/test.txt`).
        #[arg(long)]
        split: String,
        /// JSON: `[{"image": "000001", "class": "dog", "score": 0.93, "box": [x1, y1, x2,
        /// y2]}, ...]`, the devkit's inclusive pixels.
        #[arg(long)]
        detections: PathBuf,
        /// `11points` (VOC2007's) or `area`; default: 11points for VOC2007, else area.
        #[arg(long)]
        metric: Option<ApMode>,
    },
}

fn devkit(root: &Path) -> PathBuf {
    if !root.join("ImageSets").is_dir() && root.join("VOC2007").join("ImageSets").is_dir() {
        root.join("VOC2007")
    } else {
        root.to_path_buf()
    }
}

pub fn run(command: DataCommand) -> memsave::Result<()> {
    match command {
        DataCommand::SynthVoc { dir, images, seed } => {
            let written = write_synthetic_voc(&dir, images, seed)?;
            eprintln!("memsave: wrote {images} images to {}", written.display());
            Ok(())
        }
        DataCommand::VocMap {
            root,
            split,
            detections,
            metric,
        } => {
            let root = devkit(&root);
            let list = root
                .join("ImageSets")
                .join("Main")
                .join(format!("{split}.txt"));
            let images = read_split(&list, &root)?;
            let records = read_detections(&detections)?;
            let voc2007 = root
                .canonicalize()
                .unwrap_or_else(|_| root.clone())
                .to_string_lossy()
                .contains("VOC2007");
            let mode = metric.unwrap_or(if voc2007 {
                ApMode::ElevenPoints
            } else {
                ApMode::Area
            });
            let result = voc_map(&images, &records, 0.5, mode)
                .map_err(|e| memsave::Error::data_file(detections, "cannot be scored", e))?;
            println!("{result}");
            Ok(())
        }
    }
}
