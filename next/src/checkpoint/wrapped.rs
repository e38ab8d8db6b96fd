//! Any Burn module as a recompute segment, without a block of one's own around it:
//! [`Checkpointed`] wraps a module (Burn's `TransformerEncoderLayer`, another crate's
//! `#[memsave::model]` block) and gives it the `with_cp` switch a `#[memsave::model]` block has, so that a
//! field of it (or a `Vec` of them) marked `#[with_cp]` is a segment the switches, the plans'
//! paths and `"dynamic"` reach. Its forward is the wrapped module's own, called in a closure:
//!
//! ```
//! use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
//! use burn::nn::{Linear, LinearConfig};
//! use burn::prelude::*;
//! use memsave_macros::model;
//! use memsave_next::checkpoint::{segment_paths, set_with_cp, Checkpointed};
//!
//! #[model]
//! #[derive(Module, Debug)]
//! struct Encoder {
//!     embed: Linear,
//!     #[with_cp]
//!     layers: Vec<Checkpointed<TransformerEncoderLayer>>, // Burn's layers, their Dropouts too
//! }
//!
//! impl Encoder {
//!     fn forward(&self, x: Tensor<3>) -> Tensor<3> {
//!         let x = self.embed.forward(x);
//!         self.layers.iter().fold(x, |x, layer| {
//!             layer.forward_with(x, |layer, x| layer.forward(x, None, None))
//!         })
//!     }
//! }
//!
//! let device = Device::flex().autodiff();
//! let layers = TransformerEncoderConfig::new(16, 32, 2, 2).init(&device).layers;
//! let encoder = Encoder {
//!     embed: LinearConfig::new(8, 16).init(&device),
//!     layers: layers.into_iter().map(Checkpointed::new).collect(),
//! };
//! assert_eq!(segment_paths(&encoder), ["layers.0", "layers.1"]);
//! let encoder = set_with_cp(encoder, true); // every layer recomputed in backward
//! let x = Tensor::<3>::ones([2, 4, 8], &device);
//! let grads = encoder.forward(x).powi_scalar(2).mean().backward();
//! ```

use burn::module::Module;

use super::{checkpoint_with, CheckpointModule, HasWithCp, Options, Segment, SegmentId};
use crate::fp16::{Fp16Module, Precision};

/// A module of any type with a `with_cp` switch: its forward, called through
/// [`Checkpointed::forward_with`], is a recompute segment while the switch is on (see the
/// [module docs](self)). The module is `inner` (no `Deref`: a forward called on it directly
/// would not be a segment). In a model memsave trains the module must be an `Fp16Module`
/// (Burn's layers are, and `#[memsave::model]` modules).
#[derive(Module, Debug)]
pub struct Checkpointed<M: Module> {
    /// The wrapped module.
    pub inner: M,
    /// Whether its forward is recomputed in backward (the switch `set_with_cp` and plans set).
    pub with_cp: bool,
}

impl<M: Module + 'static> Checkpointed<M> {
    /// `inner` with its switch off (a model's `set_with_cp`, a plan or `"dynamic"` turns it on).
    pub fn new(inner: M) -> Self {
        Checkpointed {
            inner,
            with_cp: false,
        }
    }

    /// `forward(&inner, input)`: a recompute segment while the switch is on (its activations
    /// freed after the forward and recomputed in backward, Burn's random layers replaying their
    /// draws, running statistics updated once), the plain call while it is off. `forward` calls
    /// the wrapped module's own forward (`|layer, x| layer.forward(x, None, None)`); tensors it
    /// captures from outside are constants of the segment: pass what needs a gradient in
    /// `input` (a tuple, a `Vec`, an `Option`).
    pub fn forward_with<I, O, F>(&self, input: I, forward: F) -> O
    where
        I: Segment,
        O: Segment,
        F: Fn(&M, I) -> O + Send + Sync + 'static,
    {
        let options = Options::new().method("forward").enabled(self.with_cp);
        checkpoint_with(options, &self.inner, input, forward)
    }

    /// The wrapped module.
    pub fn into_inner(self) -> M {
        self.inner
    }
}

impl<M: Module> HasWithCp for Checkpointed<M> {
    fn with_cp(&self) -> bool {
        self.with_cp
    }
}

impl<M: Module + 'static> CheckpointModule for Checkpointed<M> {
    type Mark = crate::checkpoint::__private::Marked;

    fn set_with_cp(mut self, on: bool) -> Self {
        self.with_cp = on;
        self
    }

    fn set_with_cp_by_path(mut self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        self.with_cp = on(path);
        self
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        visit(path, SegmentId::of(&self.inner));
    }
}

impl<M: Module + Fp16Module> Fp16Module for Checkpointed<M> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Checkpointed {
            inner: self.inner.wrap_fp16(precision),
            with_cp: self.with_cp,
        }
    }

    fn visit_with_cp_flags(&self, visit: &mut dyn FnMut(SegmentId, bool)) {
        visit(SegmentId::of(&self.inner), self.with_cp);
    }
}
