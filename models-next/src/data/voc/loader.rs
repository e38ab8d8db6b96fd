//! VOC batches for the runner, made ahead of time by background threads (MMDetection's
//! `workers_per_gpu`): the runner asks for batch `(epoch, index)`, the workers have been
//! decoding that one and the next ones meanwhile, so that the model does not wait on JPEG
//! decoding. Batches depend only on `(epoch, index)` and the seed (order, flips): a resumed
//! run sees the batches the uninterrupted run saw.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use burn::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::pipeline::{Pipeline, Step};
use super::{read_splits, OneOrMany, VocImage};
use crate::detection::boxes::BBox;
use crate::detection::{DetectionBatch, ImageMeta};
use crate::memsave::parallel::Shard;
use crate::memsave::train::{BatchFootprint, DataSource};
use crate::memsave::{Error, Result};

/// `type` of a data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DatasetType {
    /// Pascal VOC in the devkit's layout.
    VOCDataset,
}

/// `[data.train]`, `[data.test]`: MMDetection's `dict(type='VOCDataset', ann_file=...,
/// img_prefix=..., pipeline=[...])`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VocDatasetConfig {
    /// `"VOCDataset"`.
    #[serde(rename = "type")]
    pub kind: DatasetType,
    /// The split list(s): `VOC2007/ImageSets/Main/trainval.txt`.
    pub ann_file: OneOrMany,
    /// The devkit folder(s) of each list: `VOC2007/`.
    pub img_prefix: OneOrMany,
    /// The steps; absent, MMDetection's VOC pipeline at (1000, 600) (training: flip 0.5).
    #[serde(default)]
    pub pipeline: Option<Vec<Step>>,
    /// A damaged image (a truncated JPEG, a header that disagrees with its annotation) is an
    /// error naming it (`false`, the default), or, `true`, every image is checked when the set
    /// is read and the damaged ones are left out with one warning that counts and names them.
    #[serde(default)]
    pub skip_bad_images: bool,
}

/// `[data]` of a detector: MMDetection's `data = dict(samples_per_gpu=2, workers_per_gpu=2,
/// train=..., val=..., test=...)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetectionDataSection {
    /// Images per batch.
    pub samples_per_gpu: usize,
    /// Threads making batches ahead (0: made when asked).
    #[serde(default = "two")]
    pub workers_per_gpu: usize,
    /// Training data.
    pub train: VocDatasetConfig,
    /// Validation data (the evaluation hook's; absent: `test`).
    #[serde(default)]
    pub val: Option<VocDatasetConfig>,
    /// Test data (`memsave test`).
    pub test: VocDatasetConfig,
}

fn two() -> usize {
    2
}

impl VocDatasetConfig {
    /// The compiled pipeline; `field` is `data.train` or `data.test`.
    pub fn pipeline(&self, field: &str, training: bool) -> Result<Pipeline> {
        match &self.pipeline {
            Some(steps) => Pipeline::from_steps(steps, &format!("{field}.pipeline")),
            None if training => Ok(Pipeline::train([1000, 600])),
            None => Ok(Pipeline::test([1000, 600])),
        }
    }

    /// VOC2007 is scored with the 11-point AP (MMDetection: `year == 2007`), anything else
    /// with the area under the curve.
    pub fn is_voc2007(&self) -> bool {
        self.img_prefix
            .paths()
            .iter()
            .all(|p| p.to_string_lossy().contains("VOC2007"))
    }
}

/// A batch made on the host.
#[derive(Clone, Debug)]
pub struct HostBatch {
    /// `[n, 3, height, width]`, padded to the batch's largest image.
    pub pixels: Vec<f32>,
    /// `[n, 3, height, width]`.
    pub shape: [usize; 4],
    /// Per image.
    pub metas: Vec<ImageMeta>,
    /// Per image.
    pub boxes: Vec<Vec<BBox>>,
    /// Per image.
    pub labels: Vec<Vec<usize>>,
}

/// Runs the pipeline on `images` (flips as given) and pads them to one size.
pub fn host_batch(pipeline: &Pipeline, images: &[&VocImage], flips: &[bool]) -> Result<HostBatch> {
    let scales = vec![pipeline.img_scale; images.len()];
    host_batch_at(pipeline, images, flips, &scales)
}

/// [`host_batch`], each image at its own scale (multi-scale training), padded to the batch's
/// largest (MMDetection's collate).
pub fn host_batch_at(
    pipeline: &Pipeline,
    images: &[&VocImage],
    flips: &[bool],
    scales: &[[usize; 2]],
) -> Result<HostBatch> {
    let mut items = Vec::with_capacity(images.len());
    for ((image, &flip), &scale) in images.iter().zip(flips).zip(scales) {
        items.push(pipeline.apply_at(image, flip, scale)?);
    }
    let height = items.iter().map(|i| i.1.pad_shape[0]).max().unwrap_or(0);
    let width = items.iter().map(|i| i.1.pad_shape[1]).max().unwrap_or(0);
    let mut pixels = vec![0.0f32; items.len() * 3 * height * width];
    let (mut metas, mut boxes, mut labels) = (Vec::new(), Vec::new(), Vec::new());
    for (n, (values, meta, b, l)) in items.into_iter().enumerate() {
        let [h, w] = meta.pad_shape;
        for c in 0..3 {
            for y in 0..h {
                let src = &values[(c * h + y) * w..(c * h + y + 1) * w];
                let start = ((n * 3 + c) * height + y) * width;
                pixels[start..start + w].copy_from_slice(src);
            }
        }
        metas.push(meta);
        boxes.push(b);
        labels.push(l);
    }
    Ok(HostBatch {
        shape: [metas.len(), 3, height, width],
        pixels,
        metas,
        boxes,
        labels,
    })
}

struct Plan {
    images: Vec<VocImage>,
    pipeline: Pipeline,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    /// This peer's part of the images (all of them unless data parallel).
    shard: Shard,
}

impl Plan {
    fn batches_per_epoch(&self) -> usize {
        self.shard.len(self.images.len()).div_ceil(self.batch_size)
    }

    fn make(&self, epoch: usize, index: usize) -> Result<HostBatch> {
        let mut order: Vec<usize> = (0..self.images.len()).collect();
        if self.shuffle {
            let mut rng = StdRng::seed_from_u64(self.seed ^ ((epoch as u64 + 1) * 0x9E37_79B9));
            for i in (1..order.len()).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
        }
        let order = self.shard.select(&order);
        let start = index * self.batch_size;
        let ids = order
            .get(start..(start + self.batch_size).min(order.len()))
            .filter(|ids| !ids.is_empty())
            .ok_or_else(|| Error::Data(format!("epoch {epoch} has no batch {index}")))?;
        let images: Vec<&VocImage> = ids.iter().map(|&i| &self.images[i]).collect();
        // Each image's flip, then its scale, from a stream of its own (seeded by the run, the
        // epoch and the image): the same batches whichever worker makes them.
        let (flips, scales): (Vec<bool>, Vec<[usize; 2]>) = ids
            .iter()
            .map(|&i| {
                let mut rng = StdRng::seed_from_u64(
                    self.seed.wrapping_mul(31) ^ ((epoch as u64) << 32) ^ i as u64,
                );
                let flip = rng.random::<f32>() < self.pipeline.flip_ratio;
                let scale = self.pipeline.draw_scale(|n| rng.random_range(0..n));
                (flip, scale)
            })
            .unzip();
        host_batch_at(&self.pipeline, &images, &flips, &scales)
    }
}

type Key = (usize, usize);

#[derive(Default)]
struct Queue {
    pending: VecDeque<Key>,
    requested: HashSet<Key>,
    done: HashMap<Key, Result<HostBatch>>,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
}

/// A VOC split as training (or test) batches.
pub struct VocDetection {
    plan: Arc<Plan>,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    device: Device,
}

impl VocDetection {
    /// The device it was made for: where direct calls (evaluation) make batches (on it without
    /// autodiff); the runner passes its own to [`DataSource::batch`].
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Reads the split of `config` (`field` names it in errors) for batches of `batch_size`,
    /// shuffled and flipped by `seed` when `training`, made by `workers` background threads.
    pub fn new(
        config: &VocDatasetConfig,
        field: &str,
        training: bool,
        batch_size: usize,
        workers: usize,
        seed: u64,
        device: Device,
    ) -> Result<Self> {
        Self::new_shard(
            config,
            field,
            training,
            batch_size,
            workers,
            seed,
            Shard::whole(),
            device,
        )
    }

    /// [`VocDetection::new`] reading only `shard` of the split (PyTorch's
    /// `DistributedSampler`: the same shuffled order on every peer, each taking its share).
    #[allow(clippy::too_many_arguments)]
    pub fn new_shard(
        config: &VocDatasetConfig,
        field: &str,
        training: bool,
        batch_size: usize,
        workers: usize,
        seed: u64,
        shard: Shard,
        device: Device,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::invalid("data.samples_per_gpu", "must be at least 1"));
        }
        let pipeline = config.pipeline(field, training)?;
        let mut images = read_splits(&config.ann_file, &config.img_prefix)?;
        if config.skip_bad_images {
            images = skip_bad_images(images, field)?;
        }
        let plan = Arc::new(Plan {
            images,
            pipeline,
            batch_size,
            shuffle: training,
            seed,
            shard,
        });
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
        });
        let workers = (0..workers)
            .map(|k| {
                let (plan, shared) = (plan.clone(), shared.clone());
                std::thread::Builder::new()
                    .name(format!("memsave-data-{k}"))
                    .spawn(move || work(&plan, &shared))
                    .expect("spawning a data thread")
            })
            .collect();
        Ok(VocDetection {
            plan,
            shared,
            workers,
            device,
        })
    }

    /// The images and their annotations (difficult objects included), in split order.
    pub fn images(&self) -> &[VocImage] {
        &self.plan.images
    }

    /// The compiled pipeline.
    pub fn pipeline(&self) -> &Pipeline {
        &self.plan.pipeline
    }

    /// Batch `(epoch, index)` on the host, from the workers when there are some.
    pub fn host(&self, epoch: usize, index: usize) -> Result<HostBatch> {
        if self.workers.is_empty() {
            return self.plan.make(epoch, index);
        }
        let per_epoch = self.plan.batches_per_epoch();
        if index >= per_epoch {
            return self.plan.make(epoch, index);
        }
        let ahead = 2 * self.workers.len();
        let mut queue = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        // This batch and the next ones, across the epoch's end.
        for k in 0..=ahead {
            let position = epoch * per_epoch + index + k;
            let key = (position / per_epoch, position % per_epoch);
            if queue.requested.insert(key) {
                queue.pending.push_back(key);
            }
        }
        self.shared.changed.notify_all();
        let key = (epoch, index);
        loop {
            if let Some(result) = queue.done.remove(&key) {
                queue.requested.remove(&key);
                return result;
            }
            if self.workers.iter().all(|w| w.is_finished()) {
                drop(queue);
                return self.plan.make(epoch, index);
            }
            queue = self
                .shared
                .changed
                .wait_timeout(queue, Duration::from_millis(200))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

fn work(plan: &Plan, shared: &Shared) {
    loop {
        let key = {
            let mut queue = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if queue.closed {
                    return;
                }
                if let Some(key) = queue.pending.pop_front() {
                    break key;
                }
                queue = shared
                    .changed
                    .wait(queue)
                    .unwrap_or_else(|p| p.into_inner());
            }
        };
        // A thread boundary: a batch's decoding and augmentation run here, and the loader's
        // caller waits for their result; a panic becomes that batch's error rather than a
        // batch that never comes.
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| plan.make(key.0, key.1)))
                .unwrap_or_else(|_| {
                    Err(Error::Data(format!(
                        "the data thread panicked making batch {key:?}"
                    )))
                });
        let mut queue = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.done.insert(key, result);
        shared.changed.notify_all();
    }
}

impl Drop for VocDetection {
    fn drop(&mut self) {
        {
            let mut queue = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            queue.closed = true;
        }
        self.shared.changed.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl DataSource<DetectionBatch> for VocDetection {
    fn batches_per_epoch(&self) -> usize {
        self.plan.batches_per_epoch()
    }

    fn footprint(&self) -> Option<BatchFootprint> {
        let [long, short] = self.plan.pipeline.img_scale;
        let d = self.plan.pipeline.size_divisor as u64;
        let side = |s: usize| (s as u64).div_ceil(d) * d;
        let n = self.plan.batch_size as u64;
        Some(BatchFootprint {
            bytes: n * 3 * side(long.max(short)) * side(long.min(short)) * 4,
            what: format!(
                "{n} images of at most 3 x {} x {}, fp32",
                long.max(short),
                long.min(short)
            ),
            smaller: "lower `data.samples_per_gpu` or the pipeline's `img_scale`".to_string(),
        })
    }

    fn batch(&self, epoch: usize, index: usize, device: &Device) -> Result<DetectionBatch> {
        let host = self.host(epoch, index)?;
        Ok(DetectionBatch {
            images: Tensor::from_data(TensorData::new(host.pixels, host.shape), device),
            metas: host.metas,
            gt_bboxes: host.boxes,
            gt_labels: host.labels,
        })
    }
}

/// Where a file of the split lives, for messages.
pub fn describe(config: &VocDatasetConfig) -> String {
    let lists: Vec<PathBuf> = config.ann_file.paths();
    lists
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `images` without the damaged ones ([`super::pipeline::check_image`]), with one `memsave`
/// warning event counting and naming them; an error when none is left.
fn skip_bad_images(images: Vec<VocImage>, field: &str) -> Result<Vec<VocImage>> {
    let total = images.len();
    let mut bad = Vec::new();
    let good: Vec<VocImage> = images
        .into_iter()
        .filter(|image| match super::pipeline::check_image(image) {
            Ok(()) => true,
            Err(error) => {
                bad.push(error.to_string());
                false
            }
        })
        .collect();
    if !bad.is_empty() {
        tracing::warn!(
            target: "memsave",
            key = field,
            skipped = bad.len(),
            total,
            "{field}: skipped {} of {total} images (`skip_bad_images`): {}",
            bad.len(),
            bad.join("; ")
        );
    }
    if good.is_empty() {
        return Err(Error::Data(format!(
            "{field}: every one of its {total} images is damaged"
        )));
    }
    Ok(good)
}
