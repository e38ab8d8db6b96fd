//! CPU staging's settings, as a config writes them (`[offload]`); each runtime's staging reads
//! them.

/// How activation offload runs (memsave's `checkpoint::offload` docs); on while set with
/// memsave's `checkpoint::set_activation_offload`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationOffload {
    /// Tensors smaller than this stay on the device (torchtune's `min_offload_size`, 1 KiB).
    pub min_bytes: u64,
    /// The most device bytes whose copy to the host is under way (their device copies still
    /// held); past it the forward waits for the copies.
    pub max_in_flight: u64,
    /// How many segments backward brings back ahead of the one it recomputes (0: each when its
    /// recomputation asks). Transformer Engine's advice for full overlap: two.
    pub prefetch: usize,
}

impl Default for ActivationOffload {
    fn default() -> Self {
        ActivationOffload {
            min_bytes: 1024,
            max_in_flight: 256 << 20,
            prefetch: 2,
        }
    }
}
