//! Gradients averaged over the peers as backward makes them (ZeRO stage 2's reduction to the
//! owners): each parameter's tap ([`crate::train::taps`]) hands its final gradient over, it is
//! averaged with the other peers' at once, kept by the peer that steps it and dropped by the
//! others, so that no peer ever holds the whole set of gradients.
//!
//! Every peer must make the same all-reduces in the same order. The taps run in the reverse of
//! the model's visiting order, the same on every peer; a parameter whose tap does not run on a
//! peer (a branch its data did not take) is reduced there when a later tap runs, or at the
//! backward's end ([`BackwardReduce::end`], a step below every tap), so that the calls stay in
//! step: with the peer's sum of the group's earlier micro-batches where it has one
//! ([`Earlier`]), else with zeros. Each of these is made inside the backward: peers on threads of
//! one process share Burn's graph registry, and a peer whose backward has returned takes every
//! graph's lock to clean up, which waits for a peer still in its backward. After backward one
//! more all-reduce (which no peer's backward waits for) counts which peers had each gradient:
//! one that no peer had has none (as in plain data parallelism); an owner that had none itself
//! receives the others' mean then.
//!
//! Exactness: an all-reduce sums element by element, so a parameter's mean is the same bits
//! whether it travels alone or in a bucket ([`super::all_reduce_grads`]). One difference is
//! left: plain data parallelism averages a half gradient that some peers lack in fp32; here it
//! is averaged in its own precision (under accumulation both average in fp32).

use std::collections::{HashMap, HashSet};

use burn::backend::autodiff::grads::Gradients;
use burn::backend::Autodiff;
use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};

use super::{all_reduce_values, Collective, Reduce, SharedCollective};
use crate::{Error, Result};

/// The peers a backward pass averages each gradient over, and the parameters this peer keeps
/// (ZeRO: its own part; `None`: every one).
pub struct TapPeers<K: Backend> {
    pub(crate) collective: SharedCollective<K>,
    pub(crate) owned: Option<HashSet<ParamId>>,
}

impl<K: Backend> TapPeers<K> {
    /// Averaging over `collective`, keeping the parameters in `owned` (all where `None`).
    pub fn new(collective: SharedCollective<K>, owned: Option<HashSet<ParamId>>) -> Self {
        TapPeers { collective, owned }
    }
}

/// A tapped parameter: its id, shape and precision, and how to take its sum (of earlier
/// micro-batches) out of the group's sums (`true`: a copy, the sums keep it).
pub(crate) struct Tapped<K: Backend> {
    pub(crate) id: ParamId,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) take_sum: fn(&mut GradientsParams, ParamId, bool) -> Option<FloatTensor<K>>,
}

/// [`Tapped::take_sum`] for a parameter of rank `D`.
pub(crate) fn take_sum<K: Backend, const D: usize>(
    sums: &mut GradientsParams,
    id: ParamId,
    keep: bool,
) -> Option<FloatTensor<K>> {
    let sum = if keep {
        sums.get::<K, D>(id)
    } else {
        sums.remove::<K, D>(id)
    };
    sum.map(|sum| sum.into_primitive().tensor())
}

/// Where this peer's sum of the group's earlier micro-batches is (accumulation), for a
/// parameter whose tap did not run: it is reduced in the gradient's place.
pub(crate) enum Earlier<'a, K: Backend> {
    /// No sums (no accumulation, or the group's first micro-batch).
    Nothing,
    /// Under mixed precision: the group's fp32 sums, added as the gradients come; what is taken
    /// is kept there where `keep` (a norm pass, before the step pass).
    Sums {
        sums: &'a mut GradientsParams,
        keep: bool,
    },
    /// In fp32: the sums seeded the backward, each on its parameter's tap's node
    /// ([`crate::train::taps::seeded_on`]); a tap that did not run leaves it in `grads`, the
    /// gradients of the backward under way. `keys`: the taps' nodes.
    Seeded {
        grads: &'a mut Gradients,
        keys: &'a HashMap<ParamId, FloatTensor<Autodiff<K>>>,
    },
}

impl<K: Backend> Earlier<'_, K> {
    /// `tapped`'s sum, where there is one.
    fn take(&mut self, tapped: &Tapped<K>) -> Option<FloatTensor<K>> {
        match self {
            Earlier::Nothing => None,
            Earlier::Sums { sums, keep } => (tapped.take_sum)(sums, tapped.id, *keep),
            Earlier::Seeded { grads, keys } => keys
                .get(&tapped.id)
                .and_then(|key| crate::train::taps::seeded_on::<K>(grads, key)),
        }
    }
}

/// One backward pass's averaging (see the module docs).
pub(crate) struct BackwardReduce<K: Backend> {
    peers: TapPeers<K>,
    device: K::Device,
    /// The tapped parameters in the model's visiting order (their taps run in reverse).
    order: Vec<Tapped<K>>,
    position: HashMap<ParamId, usize>,
    /// The parameters from this position on are reduced.
    below: usize,
    /// Whether this peer had each parameter's gradient.
    present: Vec<bool>,
    /// The means this peer keeps but had no gradient of itself (kept until the count says
    /// whether any peer had one).
    deferred: HashMap<ParamId, FloatTensor<K>>,
    error: Option<Error>,
}

impl<K: Backend> BackwardReduce<K> {
    /// The averaging of `order`'s gradients (in the model's visiting order) over `peers`.
    pub(crate) fn new(peers: TapPeers<K>, device: &K::Device, order: Vec<Tapped<K>>) -> Self {
        let position = order
            .iter()
            .enumerate()
            .map(|(position, tapped)| (tapped.id, position))
            .collect();
        BackwardReduce {
            peers,
            device: device.clone(),
            below: order.len(),
            present: vec![false; order.len()],
            position,
            order,
            deferred: HashMap::new(),
            error: None,
        }
    }

    fn keeps(&self, id: &ParamId) -> bool {
        self.peers
            .owned
            .as_ref()
            .is_none_or(|owned| owned.contains(id))
    }

    fn all_reduce(&mut self, tensor: FloatTensor<K>) -> Option<FloatTensor<K>> {
        if self.error.is_some() {
            return None;
        }
        match self.peers.collective.all_reduce(tensor, Reduce::Mean) {
            Ok(mean) => Some(mean),
            Err(error) => {
                self.error = Some(error);
                None
            }
        }
    }

    /// The mean over the peers of parameter `id`'s gradient `grad`, where this peer keeps it
    /// (the parameters whose taps did not run since the last one are reduced first, with their
    /// sums of the group's earlier micro-batches from `earlier` where there are some).
    pub(crate) fn reduce<const D: usize>(
        &mut self,
        id: ParamId,
        grad: Tensor<K, D>,
        earlier: &mut Earlier<'_, K>,
    ) -> Option<Tensor<K, D>> {
        let Some(&position) = self.position.get(&id) else {
            // Not tapped in this pass: nothing to agree on.
            return Some(grad);
        };
        if position >= self.below {
            // The taps ran out of the model's order: the peers' calls could not match.
            self.error.get_or_insert_with(|| {
                Error::invalid(
                    "zero_stage",
                    "a parameter's gradient came after those of the parameters before it in \
                     the model; the gradients cannot be averaged in backward",
                )
            });
            return None;
        }
        self.flush(position + 1, earlier);
        self.below = position;
        self.present[position] = true;
        let mean = self.all_reduce(grad.into_primitive().tensor())?;
        self.keeps(&id)
            .then(|| Tensor::from_primitive(TensorPrimitive::Float(mean)))
    }

    /// Reduces the parameters from `down_to` up to those already reduced, whose taps did not
    /// run: with this peer's sum of earlier micro-batches where it has one, else zeros (in fp32
    /// where the sums are fp32 beside half gradients, as they are).
    fn flush(&mut self, down_to: usize, earlier: &mut Earlier<'_, K>) {
        let summing = matches!(earlier, Earlier::Sums { .. });
        while self.below > down_to {
            let position = self.below - 1;
            self.below = position;
            let tapped = &self.order[position];
            let id = tapped.id;
            let sent = match earlier.take(tapped) {
                Some(sum) => {
                    self.present[position] = true;
                    sum
                }
                None => {
                    let tapped = &self.order[position];
                    let elements = tapped.shape.num_elements();
                    let dtype = if summing { DType::F32 } else { tapped.dtype };
                    let zeros = Tensor::<K, 1>::zeros([elements], &self.device)
                        .cast(dtype)
                        .into_primitive()
                        .tensor();
                    K::float_reshape(zeros, tapped.shape.clone())
                }
            };
            if let Some(mean) = self.all_reduce(sent) {
                if self.keeps(&id) {
                    self.deferred.insert(id, mean);
                }
            }
        }
    }

    /// At the end of backward, after every tap ([`crate::train::taps::with_end`]): the
    /// parameters whose taps did not run are reduced (with their sums from `earlier`), inside
    /// the backward as the taps' are.
    pub(crate) fn end(&mut self, earlier: &mut Earlier<'_, K>) {
        self.flush(0, earlier);
    }

    /// After backward (which ended with [`Self::end`]: every parameter is reduced), the peers
    /// count who had each gradient. Returns the parameters some peer had a gradient of, and the
    /// means this peer keeps of those it had none of itself.
    pub(crate) fn finish(
        &mut self,
    ) -> Result<(HashSet<ParamId>, HashMap<ParamId, FloatTensor<K>>)> {
        // After backward, a peer still in its backward could wait for these (see the module
        // docs): the passes end their backward with `end`. Were one not to, zeros keep the
        // peers' calls in step.
        debug_assert_eq!(
            self.below, 0,
            "the backward ended without `BackwardReduce::end`"
        );
        self.flush(0, &mut Earlier::Nothing);
        if let Some(error) = self.error.take() {
            return Err(error);
        }
        let present: Vec<f64> = self.present.iter().map(|&p| p as u8 as f64).collect();
        let counts =
            all_reduce_values(&*self.peers.collective, &present, Reduce::Sum, &self.device)?;
        let mut reached = HashSet::new();
        let mut deferred = HashMap::new();
        for (tapped, count) in self.order.iter().zip(counts) {
            if count > 0.0 {
                reached.insert(tapped.id);
                if let Some(mean) = self.deferred.remove(&tapped.id) {
                    deferred.insert(tapped.id, mean);
                }
            }
        }
        self.deferred.clear();
        Ok((reached, deferred))
    }

    /// The peers.
    pub(crate) fn collective(&self) -> &dyn Collective<K> {
        &*self.peers.collective
    }

    /// Whether this peer keeps only its part (ZeRO).
    pub(crate) fn sharded(&self) -> bool {
        self.peers.owned.is_some()
    }
}

#[cfg(all(test, feature = "parallel"))]
mod tests {
    use burn::backend::Flex;

    use super::*;
    use crate::parallel::{run_local, Topology};

    /// What a peer ends with: the means it kept in backward and after, and the parameters
    /// some peer had a gradient of (positions).
    type Ends = (Vec<(usize, Vec<f32>)>, Vec<(usize, Vec<f32>)>, Vec<usize>);

    #[test]
    fn gradients_a_peer_lacks_are_reduced_with_zeros_in_step_and_their_owner_gets_the_mean() {
        // Four parameters; their taps run from the last. Parameter 3: on both peers.
        // Parameter 2: on peer 1 only, owned by peer 0. Parameter 1: on neither. Parameter 0:
        // on peer 0 only, its tap the last (peer 1 reduces it at the end), owned by peer 1.
        let ids: Vec<ParamId> = (0..4).map(|_| ParamId::new()).collect();
        let (done, wait) = std::sync::mpsc::channel();
        let peers_ids = ids.clone();
        std::thread::spawn(move || {
            let ids = peers_ids;
            let ends = run_local::<Flex, Ends, _>(
                &Topology::local(2),
                vec![Default::default(); 2],
                |peer| {
                    let rank = peer.rank();
                    let device = Default::default();
                    let order = ids
                        .iter()
                        .map(|&id| Tapped {
                            id,
                            shape: Shape::new([2]),
                            dtype: DType::F32,
                            take_sum: take_sum::<Flex, 1>,
                        })
                        .collect();
                    let owned: HashSet<ParamId> = match rank {
                        0 => [ids[1], ids[2]].into(),
                        _ => [ids[0], ids[3]].into(),
                    };
                    let collective: SharedCollective<Flex> = peer.clone();
                    let mut reduce =
                        BackwardReduce::new(TapPeers::new(collective, Some(owned)), &device, order);
                    let grad =
                        |value: f32| Tensor::<Flex, 1>::from_floats([value, -value], &device);
                    let values = |t: Tensor<Flex, 1>| t.into_data().to_vec::<f32>().unwrap();
                    let mut kept = Vec::new();
                    let taps: Vec<(usize, f32)> = match rank {
                        0 => vec![(3, 1.0), (0, 8.0)],
                        _ => vec![(3, 3.0), (2, 4.0)],
                    };
                    for (position, value) in taps {
                        if let Some(mean) =
                            reduce.reduce(ids[position], grad(value), &mut Earlier::Nothing)
                        {
                            kept.push((position, values(mean)));
                        }
                    }
                    reduce.end(&mut Earlier::Nothing);
                    let (reached, deferred) = reduce.finish()?;
                    let position = |id: &ParamId| ids.iter().position(|i| i == id).unwrap();
                    let mut deferred: Vec<(usize, Vec<f32>)> = deferred
                        .into_iter()
                        .map(|(id, mean)| {
                            let mean =
                                Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(mean));
                            (position(&id), values(mean))
                        })
                        .collect();
                    deferred.sort_by_key(|(position, _)| *position);
                    let mut reached: Vec<usize> = reached.iter().map(position).collect();
                    reached.sort();
                    Ok((kept, deferred, reached))
                },
            );
            let _ = done.send(ends);
        });
        let ends = wait
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the peers' calls went out of step: they hung")
            .unwrap();
        // Peer 0 keeps nothing during backward (it had none of its own parameters' gradients),
        // and after it the mean of parameter 2 (peer 1's 4 and its zeros); parameter 1 was on
        // no peer: no gradient.
        assert_eq!(ends[0].0, vec![]);
        assert_eq!(ends[0].1, vec![(2, vec![2.0, -2.0])]);
        // Peer 1 keeps parameter 3's mean in backward, and parameter 0's (peer 0's 8, its
        // zeros) after.
        assert_eq!(ends[1].0, vec![(3, vec![2.0, -2.0])]);
        assert_eq!(ends[1].1, vec![(0, vec![4.0, -4.0])]);
        for end in &ends {
            assert_eq!(end.2, vec![0, 2, 3]);
        }
    }
}
