//! Data parallelism's Burn-free parts: what ZeRO shards (`[optimizer_config] zero_stage`),
//! which peer owns each parameter, and which samples each peer reads ([`Shard`]).

use crate::{Error, Result};

mod sampler;
pub use sampler::Shard;

/// What is sharded across the peers (`[optimizer_config] zero_stage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Nothing: every peer keeps the whole optimizer state and every gradient (plain data
    /// parallelism).
    #[default]
    Off,
    /// Stage 1: each peer keeps the optimizer state of its run of parameters only.
    OptimizerState,
    /// Stage 2: the optimizer state, and the averaged gradients, of its run only.
    Gradients,
}

impl ZeroStage {
    /// The stage of `zero_stage = n` (0, 1 or 2); errors name `zero_stage`.
    pub fn from_number(stage: u8) -> Result<Self> {
        match stage {
            0 => Ok(ZeroStage::Off),
            1 => Ok(ZeroStage::OptimizerState),
            2 => Ok(ZeroStage::Gradients),
            other => Err(Error::invalid(
                "zero_stage",
                format!(
                    "must be 0 (off), 1 (optimizer state sharded across the peers) or 2 (and \
                     the gradients), got {other}; stage 3 (the weights too, FSDP) is not \
                     available"
                ),
            )),
        }
    }

    /// The stage's number.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::OptimizerState => 1,
            ZeroStage::Gradients => 2,
        }
    }
}

/// The owner of each parameter, given their sizes in the model's order: `world` contiguous
/// runs, each as close to `total / world` bytes as the parameters' boundaries allow (a
/// parameter goes to the run its middle byte falls in).
pub fn partition(sizes: &[u64], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let total: u64 = sizes.iter().sum();
    let mut owners = Vec::with_capacity(sizes.len());
    let mut before = 0u64;
    for &size in sizes {
        let middle = before as u128 * 2 + size as u128;
        // The run whose share [r T / w, (r + 1) T / w) holds the middle byte.
        let owner = if total == 0 {
            0
        } else {
            ((middle * world as u128) / (2 * total as u128)) as usize
        };
        owners.push(owner.min(world - 1));
        before += size;
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_contiguous_and_balanced_by_bytes() {
        let owners = partition(&[10, 10, 10, 10], 2);
        assert_eq!(owners, vec![0, 0, 1, 1]);
        // A large parameter goes where its middle byte falls.
        let owners = partition(&[1, 100, 1, 1, 50, 50], 2);
        assert_eq!(owners, vec![0, 0, 1, 1, 1, 1]);
        let owners = partition(&[5; 7], 3);
        assert!(owners.windows(2).all(|pair| pair[0] <= pair[1]));
        assert_eq!(owners.first(), Some(&0));
        assert_eq!(owners.last(), Some(&2));
        // One peer owns everything.
        assert_eq!(partition(&[3, 4], 1), vec![0, 0]);
    }

    #[test]
    fn the_stage_numbers_are_checked() {
        assert_eq!(ZeroStage::from_number(2).unwrap(), ZeroStage::Gradients);
        let error = ZeroStage::from_number(3).unwrap_err().to_string();
        assert!(error.contains("zero_stage"), "{error}");
    }
}
