//! The inputs and outputs of a checkpointed segment: float tensors, alone or in containers.

use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// A value that can cross a checkpoint boundary: float tensors, and tuples, `Vec`s, arrays and
/// `Option`s of them.
///
/// The segment keeps its input (so it must be owned) and recomputes its output in backward.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the input or output of a checkpointed segment",
    label = "`#[with_cp]` keeps this value and recomputes from it in backward",
    note = "inputs and outputs of a `#[with_cp]` method must be owned float tensors, or tuples, \
            `Vec`s, arrays or `Option`s of them; keep other values in the module or compute them \
            outside the segment"
)]
pub trait Segment<B: Backend>: Clone + Send + Sized + 'static {
    /// Hands each float tensor, in a fixed order, to `f` and puts its result in its place.
    fn map_floats(self, f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self;
}

/// The float tensors of `value`, in order (cheap: tensors are reference-counted).
pub fn floats<B: Backend, S: Segment<B>>(value: &S) -> Vec<FloatTensor<B>> {
    let mut out = Vec::new();
    value.clone().map_floats(&mut |tensor| {
        out.push(tensor.clone());
        tensor
    });
    out
}

impl<B: Backend, const D: usize> Segment<B> for Tensor<B, D> {
    fn map_floats(self, f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        Tensor::from_primitive(TensorPrimitive::Float(f(self.into_primitive().tensor())))
    }
}

impl<B: Backend, T: Segment<B>> Segment<B> for Option<T> {
    fn map_floats(self, f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        self.map(|value| value.map_floats(f))
    }
}

impl<B: Backend, T: Segment<B>> Segment<B> for Vec<T> {
    fn map_floats(self, f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        self.into_iter().map(|value| value.map_floats(f)).collect()
    }
}

impl<B: Backend, T: Segment<B>, const N: usize> Segment<B> for [T; N] {
    fn map_floats(self, f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        self.map(|value| value.map_floats(f))
    }
}

macro_rules! tuple {
    ($($name:ident)+) => {
        impl<B: Backend, $($name: Segment<B>),+> Segment<B> for ($($name,)+) {
            #[allow(non_snake_case)]
            fn map_floats(self, f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
                let ($($name,)+) = self;
                ($($name.map_floats(f),)+)
            }

        }
    };
}

tuple!(T0);
tuple!(T0 T1);
tuple!(T0 T1 T2);
tuple!(T0 T1 T2 T3);
tuple!(T0 T1 T2 T3 T4);
tuple!(T0 T1 T2 T3 T4 T5);
