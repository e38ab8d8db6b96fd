//! [`TinyNet`] with two more heads that only some batches use, as a detector's branch that no
//! image of a micro-batch reaches: under accumulation their group's sums then get nothing from
//! the group's last micro-batch, and must step alone. One head comes before the net in the
//! model's visiting order (its taps run last of all, after the net's), one after it (its taps
//! run first).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use memsave::fp16::Fp16;
use memsave::models::classifier::ClassificationBatch;
use memsave::train::{DataSource, TrainModel};

use super::tiny::TinyNet;
use super::AB;

#[memsave::model]
#[derive(Module, Debug)]
pub struct Sometimes<B: Backend> {
    pub first: Linear<B>,
    pub net: TinyNet<B>,
    pub last: Linear<B>,
    pub fp16_enabled: Fp16,
}

impl<B: Backend> Sometimes<B> {
    pub fn new(device: &B::Device) -> Self {
        Sometimes {
            first: LinearConfig::new(3, 1).init(device),
            net: TinyNet::new(4, false, device),
            last: LinearConfig::new(3, 2).init(device),
            fp16_enabled: Fp16::Off,
        }
    }
}

/// A batch, and whether the loss uses [`Sometimes`]'s two heads on it.
pub struct SometimesBatch<B: Backend> {
    pub batch: ClassificationBatch<B>,
    pub heads: bool,
}

impl TrainModel<AB> for Sometimes<AB> {
    type Batch = SometimesBatch<AB>;

    fn loss(&self, batch: Self::Batch) -> Tensor<AB, 1> {
        let images = batch.batch.images;
        let loss = self
            .net
            .loss_of(self.net.forward(images.clone()), batch.batch.labels);
        if !batch.heads {
            return loss;
        }
        let dtype = self.first.weight.val().dtype();
        let pooled = images
            .mean_dim(3)
            .mean_dim(2)
            .flatten::<2>(1, 3)
            .cast(dtype);
        let square = |term: Tensor<AB, 2>| {
            let term = term.cast(loss.dtype());
            (term.clone() * term).mean().mul_scalar(0.1)
        };
        let first = square(self.first.forward(pooled.clone()));
        let last = square(self.last.forward(pooled));
        loss + first + last
    }
}

/// Batches of `inner`, the heads used at the iterations `uses` says.
pub struct SometimesData<D> {
    pub inner: D,
    pub uses: fn(usize) -> bool,
}

impl<D: DataSource<AB, ClassificationBatch<AB>>> DataSource<AB, SometimesBatch<AB>>
    for SometimesData<D>
{
    fn batches_per_epoch(&self) -> usize {
        self.inner.batches_per_epoch()
    }

    fn batch(
        &self,
        epoch: usize,
        index: usize,
        device: &burn::tensor::Device<AB>,
    ) -> memsave::Result<SometimesBatch<AB>> {
        let iteration = epoch * self.batches_per_epoch() + index;
        Ok(SometimesBatch {
            batch: self.inner.batch(epoch, index, device)?,
            heads: (self.uses)(iteration),
        })
    }
}
