//! Segments whose layers draw from the backend's global random stream.
//!
//! memsave's own random layers ([`crate::nn::Dropout`], [`crate::nn::GaussianNoise`]) draw
//! through [`super::random`]: the first forward records, the recomputation replays, and the
//! global stream is drawn from exactly as without checkpointing. Burn's layers that hold a
//! `Dropout` inside (`MultiHeadAttention`, `PositionWiseFeedForward`, the transformers) draw
//! from the backend's stream directly, which memsave can neither read nor rewind (Burn 0.21 has
//! `Backend::seed` but no way to read the state).
//!
//! So a segment whose module [draws](RandomDraws) runs under a stream of its own: at its start
//! it draws a seed from the global stream and seeds the backend with it, checkpointed or not;
//! the recomputation seeds the backend with the same seed again, and its layers draw the same
//! masks. The gradients of a step are those of the same step without checkpointing, and depend
//! on the seed the user gave the backend. What differs: after a recomputation the global stream
//! is where the recomputation left it, so the *next* step draws other masks than it would
//! without checkpointing (a different, equally random, sequence).

use burn::prelude::Backend;
use burn::tensor::{Distribution, Int, Tensor};

/// A module whose forward, in training, draws from the backend's global random stream
/// (directly or through a submodule).
///
/// `#[memsave::model]` implements it for its structs (true if a field draws); memsave
/// implements it for the layers of `burn::nn`. Implement it for a hand-written layer that calls
/// `Tensor::random` so that a checkpointed segment containing it replays its draws (or draw
/// through [`super::random`], which replays by itself).
pub trait RandomDraws {
    /// Whether a training forward draws from the global random stream.
    fn draws_random(&self) -> bool;
}

/// Draws a seed for a segment's own stream from the global stream of `device`.
pub(crate) fn draw_seed<B: Backend>(device: &B::Device) -> u64 {
    let halves = Tensor::<B, 1, Int>::random([2], Distribution::Uniform(0.0, 2147483647.0), device)
        .into_data();
    halves
        .iter::<i64>()
        .fold(0_u64, |seed, half| (seed << 31) ^ half as u64)
}

impl<T: RandomDraws> RandomDraws for Vec<T> {
    fn draws_random(&self) -> bool {
        self.iter().any(RandomDraws::draws_random)
    }
}

impl<T: RandomDraws> RandomDraws for Option<T> {
    fn draws_random(&self) -> bool {
        self.as_ref().is_some_and(RandomDraws::draws_random)
    }
}

impl<T: RandomDraws> RandomDraws for Box<T> {
    fn draws_random(&self) -> bool {
        (**self).draws_random()
    }
}

impl<T: RandomDraws, const N: usize> RandomDraws for [T; N] {
    fn draws_random(&self) -> bool {
        self.iter().any(RandomDraws::draws_random)
    }
}

/// The layers of `burn::nn` that draw: through a `Dropout` with a non-zero probability, or a
/// `GaussianNoise` with a non-zero deviation.
mod burn_layers {
    use burn::nn;
    use burn::prelude::Backend;

    use super::RandomDraws;

    impl RandomDraws for nn::Dropout {
        fn draws_random(&self) -> bool {
            self.prob > 0.0
        }
    }

    impl RandomDraws for nn::GaussianNoise {
        fn draws_random(&self) -> bool {
            self.std != 0.0
        }
    }

    impl<B: Backend> RandomDraws for nn::attention::MultiHeadAttention<B> {
        fn draws_random(&self) -> bool {
            self.dropout.draws_random()
        }
    }

    impl<B: Backend> RandomDraws for nn::transformer::PositionWiseFeedForward<B> {
        fn draws_random(&self) -> bool {
            self.dropout.draws_random()
        }
    }

    impl<B: Backend> RandomDraws for nn::transformer::TransformerEncoderLayer<B> {
        fn draws_random(&self) -> bool {
            self.mha.draws_random() || self.pwff.draws_random() || self.dropout.draws_random()
        }
    }

    impl<B: Backend> RandomDraws for nn::transformer::TransformerEncoder<B> {
        fn draws_random(&self) -> bool {
            self.layers.draws_random()
        }
    }

    impl<B: Backend> RandomDraws for nn::transformer::TransformerDecoderLayer<B> {
        fn draws_random(&self) -> bool {
            self.self_attn.draws_random()
                || self.cross_attn.draws_random()
                || self.pwff.draws_random()
                || self.dropout.draws_random()
        }
    }

    impl<B: Backend> RandomDraws for nn::transformer::TransformerDecoder<B> {
        fn draws_random(&self) -> bool {
            self.layers.draws_random()
        }
    }

    /// Its dropout is private; its configured probability is not kept: assume it draws.
    impl<B: Backend> RandomDraws for nn::attention::CrossAttention<B> {
        fn draws_random(&self) -> bool {
            true
        }
    }
}

/// memsave's random layers replay their draws by themselves.
impl RandomDraws for crate::nn::Dropout {
    fn draws_random(&self) -> bool {
        false
    }
}

/// What the macros generate code against. Not a stable API.
#[doc(hidden)]
pub mod __private {
    use std::marker::PhantomData;

    use burn::nn;

    pub use super::RandomDraws;

    /// `(&Probe(&field)).draws_random()`: the field's [`RandomDraws`] if it has one, else
    /// false (autoref specialisation: [`ViaTrait`] is found first, [`ViaFallback`] one
    /// reference deeper).
    pub struct Probe<'a, T: ?Sized>(pub &'a T);

    pub trait ViaTrait {
        fn draws_random(&self) -> bool;
    }

    impl<T: RandomDraws + ?Sized> ViaTrait for Probe<'_, T> {
        fn draws_random(&self) -> bool {
            self.0.draws_random()
        }
    }

    pub trait ViaFallback {
        fn draws_random(&self) -> bool;
    }

    impl<T: ?Sized> ViaFallback for &Probe<'_, T> {
        fn draws_random(&self) -> bool {
            false
        }
    }

    /// `SegmentProbe::<FieldType>::UNSAFE_IN_SEGMENT`: why a field of that type must not sit
    /// in a module with a `with_cp` flag, or `""` (the inherent constants below win over
    /// [`SegmentFallback`]'s when the type matches).
    pub struct SegmentProbe<T: ?Sized>(PhantomData<T>);

    pub trait SegmentFallback {
        const UNSAFE_IN_SEGMENT: &'static str = "";
    }

    impl<T: ?Sized> SegmentFallback for SegmentProbe<T> {}

    const DROPOUT: &str =
        "`burn::nn::Dropout` cannot be a layer of a module with a `with_cp` flag: \
        recomputed in backward, it would draw a new mask and the gradients would be wrong; use \
        `memsave::nn::Dropout` (same config), which replays its mask";
    const NOISE: &str = "`burn::nn::GaussianNoise` cannot be a layer of a module with a `with_cp` \
        flag: recomputed in backward, it would draw new noise and the gradients would be wrong; \
        use `memsave::nn::GaussianNoise` (same config), which replays its noise";

    macro_rules! unsafe_in_segment {
        ($ty:ty, $message:expr) => {
            impl SegmentProbe<$ty> {
                pub const UNSAFE_IN_SEGMENT: &'static str = $message;
            }
            impl SegmentProbe<Option<$ty>> {
                pub const UNSAFE_IN_SEGMENT: &'static str = $message;
            }
            impl SegmentProbe<Vec<$ty>> {
                pub const UNSAFE_IN_SEGMENT: &'static str = $message;
            }
            impl SegmentProbe<Box<$ty>> {
                pub const UNSAFE_IN_SEGMENT: &'static str = $message;
            }
            impl<const N: usize> SegmentProbe<[$ty; N]> {
                pub const UNSAFE_IN_SEGMENT: &'static str = $message;
            }
        };
    }

    unsafe_in_segment!(nn::Dropout, DROPOUT);
    unsafe_in_segment!(nn::GaussianNoise, NOISE);
}
