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
    cast_attribute_in(crate::crate_path::runtime(), kind, args, item)
}

/// [`cast_attribute`] for the runtime found (or the reason none could be chosen).
pub fn cast_attribute_in(
    runtime: Result<(TokenStream, Burn), String>,
    kind: Kind,
    args: TokenStream,
    item: TokenStream,
) -> TokenStream {
    match runtime {
        Ok((memsave, _)) => cast_attribute_for(&memsave, kind, args, item),
        Err(message) => {
            let error = syn::Error::new(proc_macro2::Span::call_site(), message).to_compile_error();
            quote!(#item #error)
        }
    }
}

/// [`cast_attribute`] for the runtime at `memsave`. The expansion is the same for either Burn:
/// it names only the runtime's `fp16` items, whose types follow the runtime's Burn.
pub fn cast_attribute_for(
    memsave: &TokenStream,
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
    let guards = match kind {
        Kind::AutoFp16 => input_guard::checks(memsave, &method),
        Kind::ForceFp32 => Vec::new(),
    };
    expand::expand(memsave, kind, &plan, &guards, method)
}
