//! The inputs and outputs of a checkpointed segment: tensors, alone or in containers.

use burn::backend::DispatchTensor;
use burn::tensor::{Bool, Int, Tensor};

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
pub trait Segment: Clone + Send + Sized + 'static {
    /// Hands each float tensor, in a fixed order, to `f` and puts its result in its place.
    fn map_floats(self, f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self;
}

/// The float tensors of `value`, in order (cheap: tensors are reference-counted).
pub fn floats<S: Segment>(value: &S) -> Vec<DispatchTensor> {
    let mut out = Vec::new();
    value.clone().map_floats(&mut |tensor| {
        out.push(tensor.clone());
        tensor
    });
    out
}

impl<const D: usize> Segment for Tensor<D> {
    fn map_floats(self, f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
        Tensor::from_dispatch(f(self.into_dispatch()))
    }
}

/// No gradient: a constant of the segment (an int tensor of token ids or labels).
impl<const D: usize> Segment for Tensor<D, Int> {
    fn map_floats(self, _f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
        self
    }
}

/// No gradient: a constant of the segment (a padding or attention mask).
impl<const D: usize> Segment for Tensor<D, Bool> {
    fn map_floats(self, _f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
        self
    }
}

/// Plain values: constants of the segment.
macro_rules! constant {
    ($($ty:ty),* $(,)?) => {$(
        impl Segment for $ty {
            fn map_floats(self, _f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
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

impl<T: Segment> Segment for Box<T> {
    fn map_floats(self, f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
        Box::new((*self).map_floats(f))
    }
}

impl<T: Segment> Segment for Option<T> {
    fn map_floats(self, f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
        self.map(|value| value.map_floats(f))
    }
}

impl<T: Segment> Segment for Vec<T> {
    fn map_floats(self, f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
        self.into_iter().map(|value| value.map_floats(f)).collect()
    }
}

impl<T: Segment, const N: usize> Segment for [T; N] {
    fn map_floats(self, f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
        self.map(|value| value.map_floats(f))
    }
}

macro_rules! tuple {
    ($($name:ident)+) => {
        impl<$($name: Segment),+> Segment for ($($name,)+) {
            #[allow(non_snake_case)]
            fn map_floats(self, f: &mut dyn FnMut(DispatchTensor) -> DispatchTensor) -> Self {
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
