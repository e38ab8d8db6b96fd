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

/// The runtime crate's path in generated code, and the Burn its code is written for: Burn 0.21
/// for `memsave-core` or `memsave`, Burn 0.22 for `memsave-next` (the port's runtime, growing
/// beside `memsave-core`: docs/src/port-0.22.md). A crate that depends on runtimes for both Burns
/// is an error: the macros cannot tell which Burn a module is written for.
///
/// `memsave-core` is looked up before `memsave` because the runtime is always a normal
/// dependency where it appears, while `memsave` may be a dev-dependency only (of
/// `memsave-models`), unusable in a library build.
pub fn runtime() -> Result<(TokenStream, Burn), String> {
    let found = |package: &str| match crate_name(package) {
        Ok(FoundCrate::Name(name)) => {
            let ident = syn::Ident::new(&name, Span::call_site());
            Some(quote!(::#ident))
        }
        // Inside memsave's own packages (their tests and examples); `src/lib.rs` of the
        // facade declares `extern crate self as memsave` for the library itself.
        Ok(FoundCrate::Itself) => {
            let ident = syn::Ident::new(&package.replace('-', "_"), Span::call_site());
            Some(quote!(::#ident))
        }
        Err(_) => None,
    };
    let v0_21 = found("memsave-core").or_else(|| found("memsave"));
    let v0_22 = found("memsave-next");
    match (v0_21, v0_22) {
        (Some(_), Some(_)) => Err("this crate depends on memsave for Burn 0.21 (`memsave` or \
                                   `memsave-core`) and for Burn 0.22 (`memsave-next`): memsave's \
                                   macros cannot tell which Burn its modules are written for; \
                                   depend on one of them"
            .to_string()),
        (Some(path), None) => Ok((path, Burn::V0_21)),
        (None, Some(path)) => Ok((path, Burn::V0_22)),
        (None, None) => Ok((quote!(::memsave), Burn::V0_21)),
    }
}
