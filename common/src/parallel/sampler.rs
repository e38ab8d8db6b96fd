//! Which samples a peer reads: PyTorch's `DistributedSampler`. Every peer shuffles the whole
//! data set the same way (one seeded order per epoch, shared), the order is padded to a multiple
//! of the number of peers by repeating its first samples, and peer `r` of `w` takes positions
//! `r, r + w, r + 2w, ...`. The shards are disjoint (but for the padding) and of equal length,
//! so every peer runs the same number of iterations per epoch; and batch `i` of the `w` peers
//! together holds exactly the samples of batch `i` of one process reading the same order with a
//! batch `w` times larger.

/// One peer's part of the data: its rank among `world` peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The peer's rank, from 0.
    pub rank: usize,
    /// The number of peers.
    pub world: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Shard::whole()
    }
}

impl Shard {
    /// All of the data (one peer).
    pub fn whole() -> Self {
        Shard { rank: 0, world: 1 }
    }

    /// Whether this is all of the data.
    pub(crate) fn is_whole(self) -> bool {
        self.world <= 1
    }

    /// Samples per epoch in each shard of a data set of `len` samples.
    pub fn len(self, len: usize) -> usize {
        len.div_ceil(self.world.max(1))
    }

    /// Whether a shard of `len` samples is empty.
    pub fn is_empty(self, len: usize) -> bool {
        self.len(len) == 0
    }

    /// This peer's samples from the epoch's `order` (the same on every peer): padded to a
    /// multiple of `world` by repeating from the start, then every `world`-th from `rank`.
    pub fn select<T: Clone>(self, order: &[T]) -> Vec<T> {
        if self.is_whole() || order.is_empty() {
            return order.to_vec();
        }
        let total = self.len(order.len()) * self.world;
        (self.rank..total)
            .step_by(self.world)
            .map(|position| order[position % order.len()].clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_padded_and_interleave_into_the_whole_order() {
        let order: Vec<usize> = (0..10).rev().collect();
        let shards: Vec<Vec<usize>> = (0..3)
            .map(|rank| Shard { rank, world: 3 }.select(&order))
            .collect();
        assert!(shards.iter().all(|shard| shard.len() == 4));
        // Position i of shard r is position i * 3 + r of the padded order.
        let mut interleaved = Vec::new();
        for i in 0..4 {
            for shard in &shards {
                interleaved.push(shard[i]);
            }
        }
        let mut padded = order.clone();
        padded.extend_from_slice(&order[..2]);
        assert_eq!(interleaved, padded);
        assert_eq!(Shard::whole().select(&order), order);
        // Two peers, an even count: disjoint, no padding.
        let a = Shard { rank: 0, world: 2 }.select(&order);
        let b = Shard { rank: 1, world: 2 }.select(&order);
        assert!(a.iter().all(|x| !b.contains(x)));
        assert_eq!(a.len() + b.len(), order.len());
    }
}
