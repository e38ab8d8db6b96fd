//! The path of the runtime crate in generated code, resolved from the user's dependencies.

use proc_macro2::{Span, TokenStream};
use proc_macro_crate::{crate_name, FoundCrate};
use quote::quote;

/// Which Burn the generated code is written for: the runtime crate found tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Burn {
    /// Burn 0.21: `memsave-core`, or `memsave`.
    V0_21,
    /// Burn 0.22: `memsave-next`, the runtime the port grows beside `memsave-core`
    /// (docs/src/port-0.22.md).
    V0_22,
}

/// `::memsave_core` for a crate that depends on the runtime directly (memsave's own crates),
/// else `::memsave` (or the user's rename of it).
///
/// The runtime is looked up first because it is always a normal dependency where it appears,
/// while `memsave` may be a dev-dependency only (of `memsave-models`), unusable in a library
/// build.
pub fn memsave() -> TokenStream {
    runtime().0
}

/// [`memsave`], and the Burn its code is written for.
pub fn runtime() -> (TokenStream, Burn) {
    for (package, burn) in [
        ("memsave-core", Burn::V0_21),
        ("memsave-next", Burn::V0_22),
        ("memsave", Burn::V0_21),
    ] {
        match crate_name(package) {
            Ok(FoundCrate::Name(name)) => {
                let ident = syn::Ident::new(&name, Span::call_site());
                return (quote!(::#ident), burn);
            }
            // Inside memsave's own packages (their tests and examples); `src/lib.rs` of the
            // facade declares `extern crate self as memsave` for the library itself.
            Ok(FoundCrate::Itself) => {
                let ident = syn::Ident::new(&package.replace('-', "_"), Span::call_site());
                return (quote!(::#ident), burn);
            }
            Err(_) => continue,
        }
    }
    (quote!(::memsave), Burn::V0_21)
}
