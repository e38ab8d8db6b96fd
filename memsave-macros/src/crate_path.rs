//! The path of the runtime crate in generated code, resolved from the user's dependencies.

use proc_macro2::{Span, TokenStream};
use proc_macro_crate::{crate_name, FoundCrate};
use quote::quote;

/// `::memsave` (or the user's rename of it), else `::memsave_core` for a crate that depends on
/// the runtime directly.
pub fn memsave() -> TokenStream {
    for package in ["memsave", "memsave-core"] {
        match crate_name(package) {
            Ok(FoundCrate::Name(name)) => {
                let ident = syn::Ident::new(&name, Span::call_site());
                return quote!(::#ident);
            }
            // Inside memsave's own package (its tests and examples) the crate is `memsave`;
            // `src/lib.rs` declares `extern crate self as memsave` for the library itself.
            Ok(FoundCrate::Itself) => {
                let ident = syn::Ident::new(&package.replace('-', "_"), Span::call_site());
                return quote!(::#ident);
            }
            Err(_) => continue,
        }
    }
    quote!(::memsave)
}
