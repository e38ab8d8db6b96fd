//! Recursive casting of float tensors between fp32 and half precision.
//!
//! The runtime under `#[auto_fp16]` and `#[force_fp32]`, usable by hand too. It follows MMCV's
//! `cast_tensor_type(inputs, src_type, dst_type)`: every float tensor whose dtype is `from` is
//! cast to `to`; tensors of any other dtype (int, bool, a float of another precision) and
//! non-tensor values pass unchanged; `Vec`, arrays, tuples, `Option`, `Box` and maps (values
//! only) are walked recursively.
//!
//! ```
//! use burn::tensor::{DType, Int, Tensor};
//! use memsave_next::cast::cast_tensor_type;
//!
//! let device = Default::default();
//! let x = Tensor::<2>::ones([2, 3], &device);
//! let labels = Tensor::<1, Int>::zeros([2], &device);
//! let (x, labels, scale) = cast_tensor_type((x, labels, 0.5_f32), DType::F32, DType::F16);
//! assert_eq!(x.dtype(), DType::F16);
//! assert_eq!(labels.dtype(), DType::I32);
//! assert_eq!(scale, 0.5);
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;

use burn::tensor::{Bool, DType, Int, Tensor};

/// A value that may hold float tensors to cast between precisions.
///
/// Implemented for float tensors (cast when their dtype is `from`), int and bool tensors and
/// plain values (unchanged), and the standard containers (walked recursively). Implement it for
/// your own argument types to let `#[auto_fp16]` and `#[force_fp32]` reach the tensors inside.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cast between fp32 and half precision",
    label = "this argument or output is cast by `#[auto_fp16]` / `#[force_fp32]`",
    note = "implement `memsave::cast::CastFloat` for `{Self}` (cast the tensors it holds, \
            pass the rest through), or leave this argument out of `apply_to = (...)`"
)]
pub trait CastFloat: Sized {
    /// Casts every float tensor of dtype `from` held by `self` to `to`.
    fn cast_float(self, from: DType, to: DType) -> Self;

    /// Hands the dtype of every float tensor held by `self` to `f`, in order (nothing by
    /// default). fp32 islands read it to cast their outputs back to the type their inputs had.
    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        let _ = f;
    }
}

/// Casts every float tensor of dtype `from` inside `value` to `to`; everything else is returned
/// unchanged. See the [module documentation](self).
pub fn cast_tensor_type<T: CastFloat>(value: T, from: DType, to: DType) -> T {
    value.cast_float(from, to)
}

impl<const D: usize> CastFloat for Tensor<D> {
    fn cast_float(self, from: DType, to: DType) -> Self {
        if self.dtype() == from && from != to {
            self.cast(to)
        } else {
            self
        }
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        f(self.dtype())
    }
}

impl<const D: usize> CastFloat for Tensor<D, Int> {
    fn cast_float(self, _from: DType, _to: DType) -> Self {
        self
    }
}

impl<const D: usize> CastFloat for Tensor<D, Bool> {
    fn cast_float(self, _from: DType, _to: DType) -> Self {
        self
    }
}

/// Plain values: nothing to cast.
macro_rules! unchanged {
    ($($ty:ty),* $(,)?) => {$(
        impl CastFloat for $ty {
            fn cast_float(self, _from: DType, _to: DType) -> Self {
                self
            }
        }
    )*};
}

unchanged!(
    (),
    bool,
    char,
    u8,
    u16,
    u32,
    u64,
    u128,
    usize,
    i8,
    i16,
    i32,
    i64,
    i128,
    isize,
    f32,
    f64,
    half::f16,
    half::bf16,
    String,
    DType,
);

impl CastFloat for &str {
    fn cast_float(self, _from: DType, _to: DType) -> Self {
        self
    }
}

impl<T: ?Sized> CastFloat for PhantomData<T> {
    fn cast_float(self, _from: DType, _to: DType) -> Self {
        self
    }
}

impl<T: CastFloat> CastFloat for Option<T> {
    fn cast_float(self, from: DType, to: DType) -> Self {
        self.map(|value| value.cast_float(from, to))
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        if let Some(value) = self {
            value.visit_float_dtypes(f)
        }
    }
}

impl<T: CastFloat> CastFloat for Box<T> {
    fn cast_float(self, from: DType, to: DType) -> Self {
        Box::new((*self).cast_float(from, to))
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        (**self).visit_float_dtypes(f)
    }
}

impl<T: CastFloat> CastFloat for Vec<T> {
    fn cast_float(self, from: DType, to: DType) -> Self {
        self.into_iter()
            .map(|value| value.cast_float(from, to))
            .collect()
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        self.iter().for_each(|value| value.visit_float_dtypes(f))
    }
}

impl<T: CastFloat> CastFloat for VecDeque<T> {
    fn cast_float(self, from: DType, to: DType) -> Self {
        self.into_iter()
            .map(|value| value.cast_float(from, to))
            .collect()
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        self.iter().for_each(|value| value.visit_float_dtypes(f))
    }
}

impl<T: CastFloat, const N: usize> CastFloat for [T; N] {
    fn cast_float(self, from: DType, to: DType) -> Self {
        self.map(|value| value.cast_float(from, to))
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        self.iter().for_each(|value| value.visit_float_dtypes(f))
    }
}

/// Maps: the values are cast, the keys are left alone (as MMCV does for dicts).
impl<K: Eq + Hash, V: CastFloat, S: BuildHasher + Default> CastFloat for HashMap<K, V, S> {
    fn cast_float(self, from: DType, to: DType) -> Self {
        self.into_iter()
            .map(|(key, value)| (key, value.cast_float(from, to)))
            .collect()
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        self.values().for_each(|value| value.visit_float_dtypes(f))
    }
}

impl<K: Ord, V: CastFloat> CastFloat for BTreeMap<K, V> {
    fn cast_float(self, from: DType, to: DType) -> Self {
        self.into_iter()
            .map(|(key, value)| (key, value.cast_float(from, to)))
            .collect()
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
        self.values().for_each(|value| value.visit_float_dtypes(f))
    }
}

macro_rules! tuple {
    ($($name:ident)+) => {
        impl<$($name: CastFloat),+> CastFloat for ($($name,)+) {
            #[allow(non_snake_case)]
            fn cast_float(self, from: DType, to: DType) -> Self {
                let ($($name,)+) = self;
                ($($name.cast_float(from, to),)+)
            }

            #[allow(non_snake_case)]
            fn visit_float_dtypes(&self, f: &mut dyn FnMut(DType)) {
                let ($($name,)+) = self;
                $($name.visit_float_dtypes(f);)+
            }
        }
    };
}

tuple!(A);
tuple!(A B);
tuple!(A B C);
tuple!(A B C D);
tuple!(A B C D E);
tuple!(A B C D E F);
tuple!(A B C D E F G);
tuple!(A B C D E F G H);
