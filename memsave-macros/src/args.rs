//! A method's typed arguments (everything but `self`), read one way for every macro.

use syn::{FnArg, PatType, Signature};

/// The typed arguments of `sig`, in order.
pub fn typed(sig: &Signature) -> Vec<&PatType> {
    sig.inputs
        .iter()
        .filter_map(|arg| match arg {
            FnArg::Typed(arg) => Some(arg),
            FnArg::Receiver(_) => None,
        })
        .collect()
}

/// The typed arguments of `sig`, in order, to rewrite.
pub fn typed_mut(sig: &mut Signature) -> impl Iterator<Item = &mut PatType> {
    sig.inputs.iter_mut().filter_map(|arg| match arg {
        FnArg::Typed(arg) => Some(arg),
        FnArg::Receiver(_) => None,
    })
}
