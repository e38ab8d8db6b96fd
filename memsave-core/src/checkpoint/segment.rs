//! The inputs and outputs of a checkpointed segment: tensors, alone or in containers.

use burn::prelude::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, Int, Tensor, TensorPrimitive};

/// A value that can cross a checkpoint boundary: tensors (float, int, bool), plain numbers and
/// flags, and tuples, `Vec`s, arrays, `Option`s and `Box`es of them.
///
/// Float tensors carry gradients through the boundary. Int and bool tensors (token ids, labels,
/// padding masks) and plain values carry none: as inputs they are constants kept with the
/// segment, as outputs they are returned without gradient. The segment keeps its input (so it
/// must be owned) and recomputes its output in backward.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the input or output of a checkpointed segment",
    label = "`#[with_cp]` keeps this value and recomputes from it in backward",
    note = "inputs and outputs of a `#[with_cp]` method must be owned tensors (float, int or \
            bool) or plain numbers, or tuples, `Vec`s, arrays, `Option`s or `Box`es of them; keep \
            other values in the module, or implement `memsave::checkpoint::Segment` for your type"
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

/// No gradient: a constant of the segment (an int tensor of token ids or labels).
impl<B: Backend, const D: usize> Segment<B> for Tensor<B, D, Int> {
    fn map_floats(self, _f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        self
    }
}

/// No gradient: a constant of the segment (a padding or attention mask).
impl<B: Backend, const D: usize> Segment<B> for Tensor<B, D, Bool> {
    fn map_floats(self, _f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        self
    }
}

/// Plain values: constants of the segment.
macro_rules! constant {
    ($($ty:ty),* $(,)?) => {$(
        impl<B: Backend> Segment<B> for $ty {
            fn map_floats(self, _f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
                self
            }
        }
    )*};
}

constant!(
    (),
    bool,
    u8,
    u16,
    u32,
    u64,
    usize,
    i8,
    i16,
    i32,
    i64,
    isize,
    f32,
    f64
);

impl<B: Backend, T: Segment<B>> Segment<B> for Box<T> {
    fn map_floats(self, f: &mut dyn FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        Box::new((*self).map_floats(f))
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
