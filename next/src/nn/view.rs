//! How a normalisation sees its input: `[outer, channels, inner]`, the groups its statistics
//! are taken over, and the activation fused after it.

/// The activation fused after the affine transform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// None: `y = x * scale + shift`.
    Identity,
    /// `max(0, .)`; its backward mask is recomputed from the input, so nothing more is kept.
    Relu,
}

/// How a normalisation groups its input (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grouping {
    /// Statistics per channel over the batch and the positions (BatchNorm).
    PerChannel,
    /// Statistics per sample and group of `channels / groups` channels (GroupNorm).
    PerSampleGroup {
        /// Number of groups; divides the channels.
        groups: usize,
    },
    /// Statistics per row over the last dimension, affine per element of it (LayerNorm); the
    /// view is `[rows, 1, features]` with the affine indexed by feature.
    PerRow,
}

/// The shape of a normalisation's input as `[outer, channels, inner]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// `N` (or the rows of a LayerNorm).
    pub outer: usize,
    /// `C` (1 for a LayerNorm).
    pub channels: usize,
    /// The positions per channel (the features of a LayerNorm).
    pub inner: usize,
}

impl View {
    /// Elements per group.
    pub fn group_size(&self, grouping: Grouping) -> usize {
        match grouping {
            Grouping::PerChannel => self.outer * self.inner,
            Grouping::PerSampleGroup { groups } => self.channels / groups * self.inner,
            Grouping::PerRow => self.inner,
        }
    }
}

/// What a normalisation's backward must compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// The input's gradient.
    pub input: bool,
    /// The affine parameters' gradients.
    pub affine: bool,
    /// Whether the statistics came from this batch (training), so that they depend on the
    /// input; otherwise (running statistics) they are constants.
    pub batch_stats: bool,
}
