//! The path of the runtime crate in generated code, resolved from the user's dependencies.

use proc_macro2::{Span, TokenStream};
use proc_macro_crate::{crate_name, FoundCrate};
use quote::quote;

/// `::memsave_core` for a crate that depends on the runtime directly (memsave's own crates),
/// else `::memsave` (or the user's rename of it).
///
/// The runtime is looked up first because it is always a normal dependency where it appears,
/// while `memsave` may be a dev-dependency only (of `memsave-models`), unusable in a library
/// build.
pub fn memsave() -> TokenStream {
    for package in ["memsave-core", "memsave"] {
        match crate_name(package) {
            Ok(FoundCrate::Name(name)) => {
                let ident = syn::Ident::new(&name, Span::call_site());
                return quote!(::#ident);
            }
            // Inside memsave's own packages (their tests and examples); `src/lib.rs` of the
            // facade declares `extern crate self as memsave` for the library itself.
            Ok(FoundCrate::Itself) => {
                let ident = syn::Ident::new(&package.replace('-', "_"), Span::call_site());
                return quote!(::#ident);
            }
            Err(_) => continue,
        }
    }
    quote!(::memsave)
}
