//! `#[with_cp]` on a method: parse -> validate -> expand.

mod expand;
mod valid;

use proc_macro2::TokenStream;
use quote::quote;
use syn::ImplItemFn;

use crate::crate_path::Burn;
use crate::ctxt::Ctxt;

/// The whole macro: the method split in a dispatcher and its segment, or the method as written
/// plus every error.
pub fn with_cp_attribute(args: TokenStream, item: TokenStream) -> TokenStream {
    with_cp_in(crate::crate_path::runtime(), args, item)
}

/// [`with_cp_attribute`] for the runtime found (or the reason none could be chosen).
pub fn with_cp_in(
    runtime: Result<(TokenStream, Burn), String>,
    args: TokenStream,
    item: TokenStream,
) -> TokenStream {
    match runtime {
        Ok(runtime) => with_cp_for(runtime, args, item),
        Err(message) => {
            let error = syn::Error::new(proc_macro2::Span::call_site(), message).to_compile_error();
            quote!(#item #error)
        }
    }
}

/// [`with_cp_attribute`] for the runtime at `memsave`, written for `burn`.
pub fn with_cp_for(
    (memsave, burn): (TokenStream, Burn),
    args: TokenStream,
    item: TokenStream,
) -> TokenStream {
    let method: ImplItemFn = match syn::parse2(item.clone()) {
        Ok(method) => method,
        Err(_) => {
            let error = syn::Error::new_spanned(
                &item,
                "`#[with_cp]` goes on a method with a body, in an `impl` block of a module, or on \
                 a field of a `#[memsave::model]` struct",
            )
            .to_compile_error();
            return quote!(#item #error);
        }
    };
    let mut cx = Ctxt::default();
    if !args.is_empty() {
        cx.error_spanned_by(
            &args,
            "`#[with_cp]` takes no options: the module's `with_cp` flag switches it on",
        );
    }
    let plan = valid::validate(&mut cx, &method);
    if let Some(errors) = cx.check() {
        return quote!(#method #errors);
    }
    expand::expand(&memsave, burn, &plan, method)
}
