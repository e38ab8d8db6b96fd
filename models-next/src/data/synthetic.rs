//! A classification data set made on the fly (Burn 0.22), as `memsave-models`' own.

use burn::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

use crate::classifier::ClassificationBatch;
use crate::memsave::parallel::Shard;
use crate::memsave::train::{BatchFootprint, DataSource};
use crate::memsave::{Error, Result};

/// A classification data set made on the fly, for runs that need no download: sample `i` has
/// class `i % num_classes` and is Gaussian noise with a brighter horizontal band whose position
/// gives the class, so a model can learn it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticClassificationConfig {
    /// Images per batch (MMDetection's name).
    pub samples_per_gpu: usize,
    /// Images per epoch.
    pub num_samples: usize,
    /// Side of the square images, in pixels.
    #[serde(default = "default_size")]
    pub image_size: usize,
    /// Seed of the images and of the shuffling.
    #[serde(default)]
    pub seed: u64,
    /// Shuffle each epoch (seeded by the epoch).
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// Standard deviation of the noise.
    #[serde(default = "default_noise")]
    pub noise: f32,
    /// Brightness added to the band that tells the class.
    #[serde(default = "default_signal")]
    pub signal: f32,
}

impl SyntheticClassificationConfig {
    /// `num_samples` images of `image_size` pixels in batches of `samples_per_gpu`, shuffled,
    /// with the default noise and signal.
    pub fn new(samples_per_gpu: usize, num_samples: usize, image_size: usize) -> Self {
        SyntheticClassificationConfig {
            samples_per_gpu,
            num_samples,
            image_size,
            seed: 0,
            shuffle: true,
            noise: default_noise(),
            signal: default_signal(),
        }
    }
}

fn default_noise() -> f32 {
    0.5
}

fn default_signal() -> f32 {
    1.5
}

fn default_size() -> usize {
    32
}

fn default_true() -> bool {
    true
}

/// The data set of a [`SyntheticClassificationConfig`], over `num_classes` classes.
#[derive(Clone, Debug)]
pub struct SyntheticClassification {
    config: SyntheticClassificationConfig,
    num_classes: usize,
    device: Device,
    shard: Shard,
}

impl SyntheticClassification {
    /// The device it was made for: where direct calls (evaluation) make batches (on it without
    /// autodiff); the runner passes its own to [`DataSource::batch`].
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Checks the configuration.
    pub fn new(
        config: SyntheticClassificationConfig,
        num_classes: usize,
        device: Device,
    ) -> Result<Self> {
        let check = |ok: bool, field: &str, message: String| {
            if ok {
                Ok(())
            } else {
                Err(Error::invalid(field, message))
            }
        };
        check(
            num_classes >= 2,
            "model.num_classes",
            format!("a classifier tells at least 2 classes apart, got {num_classes}"),
        )?;
        check(
            config.samples_per_gpu > 0,
            "data.samples_per_gpu",
            "must be at least 1".into(),
        )?;
        check(
            config.num_samples >= config.samples_per_gpu,
            "data.num_samples",
            format!(
                "must be at least samples_per_gpu ({}), got {}",
                config.samples_per_gpu, config.num_samples
            ),
        )?;
        check(
            config.image_size >= num_classes.max(8),
            "data.image_size",
            format!(
                "must be at least max(8, num_classes = {num_classes}), got {}",
                config.image_size
            ),
        )?;
        Ok(SyntheticClassification {
            config,
            num_classes,
            device,
            shard: Shard::whole(),
        })
    }

    /// The same data set, reading only `shard` of each epoch (PyTorch's `DistributedSampler`:
    /// the same shuffled order on every peer, each taking its share).
    pub fn with_shard(mut self, shard: Shard) -> Self {
        self.shard = shard;
        self
    }

    /// The order of the samples in `epoch`.
    fn order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.config.num_samples).collect();
        if self.config.shuffle {
            let mut rng =
                StdRng::seed_from_u64(self.config.seed ^ ((epoch as u64 + 1) * 0x9E37_79B9));
            for i in (1..order.len()).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
        }
        order
    }

    /// Sample `id`: `[3, size, size]` values and its class.
    fn sample(&self, id: usize) -> (Vec<f32>, i64) {
        let size = self.config.image_size;
        let class = id % self.num_classes;
        let mut rng = StdRng::seed_from_u64(self.config.seed.wrapping_mul(31) ^ id as u64);
        let band = size / self.num_classes;
        let mut pixels = Vec::with_capacity(3 * size * size);
        for _channel in 0..3 {
            for row in 0..size {
                let bright = row / band.max(1) == class;
                for _col in 0..size {
                    // Box-Muller: a standard normal from two uniforms.
                    let (u, v): (f32, f32) = (rng.random::<f32>().max(1e-7), rng.random());
                    let noise = (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos();
                    pixels.push(
                        noise * self.config.noise + if bright { self.config.signal } else { 0.0 },
                    );
                }
            }
        }
        (pixels, class as i64)
    }
}

impl DataSource<ClassificationBatch> for SyntheticClassification {
    fn batches_per_epoch(&self) -> usize {
        self.shard
            .len(self.config.num_samples)
            .div_ceil(self.config.samples_per_gpu)
    }

    fn footprint(&self) -> Option<BatchFootprint> {
        let (n, size) = (
            self.config.samples_per_gpu as u64,
            self.config.image_size as u64,
        );
        // fp32 images and i64 labels, as `batch` makes them.
        let bytes = n
            .saturating_mul(3)
            .saturating_mul(size)
            .saturating_mul(size)
            .saturating_mul(4)
            .saturating_add(n.saturating_mul(8));
        Some(BatchFootprint {
            bytes,
            what: format!("{n} images of 3 x {size} x {size}, fp32"),
            smaller: "lower `data.samples_per_gpu` or `data.image_size`".to_string(),
        })
    }

    fn batch(&self, epoch: usize, index: usize, device: &Device) -> Result<ClassificationBatch> {
        let order = self.shard.select(&self.order(epoch));
        let start = index * self.config.samples_per_gpu;
        let ids = order
            .get(start..(start + self.config.samples_per_gpu).min(order.len()))
            .filter(|ids| !ids.is_empty())
            .ok_or_else(|| Error::Data(format!("epoch {epoch} has no batch {index}")))?;
        let size = self.config.image_size;
        let mut pixels = Vec::with_capacity(ids.len() * 3 * size * size);
        let mut labels = Vec::with_capacity(ids.len());
        for &id in ids {
            let (values, label) = self.sample(id);
            pixels.extend(values);
            labels.push(label);
        }
        Ok(ClassificationBatch {
            images: Tensor::from_data(TensorData::new(pixels, [ids.len(), 3, size, size]), device),
            labels: Tensor::<1, Int>::from_data(TensorData::new(labels, [ids.len()]), device),
        })
    }
}
