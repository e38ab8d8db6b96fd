//! `#[auto_fp16]` and `#[force_fp32]`: parse -> validate -> expand.

mod attr;
mod expand;
mod input_guard;
pub mod valid;

pub use attr::Kind;
use proc_macro2::TokenStream;
use quote::quote;
use syn::ImplItemFn;

use crate::crate_path::Burn;
use crate::ctxt::Ctxt;

/// The whole macro: the rewritten method, or the method as written plus every error.
pub fn cast_attribute(kind: Kind, args: TokenStream, item: TokenStream) -> TokenStream {
    let burn = crate::crate_path::runtime().map_or(Burn::V0_21, |(_, burn)| burn);
    cast_attribute_for(burn, kind, args, item)
}

/// [`cast_attribute`] for a crate whose modules are written for `burn`.
pub fn cast_attribute_for(
    burn: Burn,
    kind: Kind,
    args: TokenStream,
    item: TokenStream,
) -> TokenStream {
    let mut method: ImplItemFn = match syn::parse2(item.clone()) {
        Ok(method) => method,
        Err(_) => {
            let message = format!(
                "`#[{}]` goes on a method with a body, in an `impl` block of a module",
                kind.name()
            );
            let error = syn::Error::new_spanned(&item, message).to_compile_error();
            return quote!(#item #error);
        }
    };

    if burn == Burn::V0_22 {
        let message = format!(
            "`#[{}]`: memsave's mixed precision is not on Burn 0.22 yet (the port's next slices, \
             docs/src/port-0.22.md); on `memsave-next` only checkpointing is; remove the \
             attribute, or depend on `memsave` (Burn 0.21)",
            kind.name()
        );
        let error = syn::Error::new(proc_macro2::Span::call_site(), message).to_compile_error();
        return quote!(#method #error);
    }
    let mut cx = Ctxt::default();
    let attr = attr::parse(&mut cx, kind, args);
    let plan = valid::validate(&mut cx, kind, &attr, &method);
    if let Some(errors) = cx.check() {
        // The conflicting attribute is dropped so that the conflict is reported once.
        method
            .attrs
            .retain(|attr| !valid::is_attr(attr, kind.other().name()));
        return quote!(#method #errors);
    }
    let memsave = crate::crate_path::memsave();
    let guards = match kind {
        Kind::AutoFp16 => input_guard::checks(&memsave, &method),
        Kind::ForceFp32 => Vec::new(),
    };
    expand::expand(&memsave, kind, &plan, &guards, method)
}
