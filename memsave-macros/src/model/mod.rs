//! `#[memsave::model]`: parse -> validate -> expand.

mod ast;
mod checkpoint;
mod expand;
mod fallback;
mod shape;
mod valid;

use proc_macro2::TokenStream;
use quote::quote;

use crate::crate_path::Burn;
use crate::ctxt::Ctxt;

/// The whole macro: the struct or enum (with memsave's field attributes removed) and its impls;
/// on error, the item, fallback impls that keep the rest of the crate quiet, and every error.
pub fn model_attribute(args: TokenStream, item: TokenStream) -> TokenStream {
    match crate::crate_path::runtime() {
        Ok(runtime) => model_for(runtime, args, item),
        Err(message) => {
            let error = syn::Error::new(proc_macro2::Span::call_site(), message).to_compile_error();
            quote!(#item #error)
        }
    }
}

/// [`model_attribute`] for the runtime at `memsave`, written for `burn`.
pub fn model_for(
    (memsave, burn): (TokenStream, Burn),
    args: TokenStream,
    item: TokenStream,
) -> TokenStream {
    let mut cx = Ctxt::default();
    if !args.is_empty() {
        cx.error_spanned_by(
            &args,
            "`#[memsave::model]` takes no options: switch strategies on the fields \
             (`#[with_cp]`, `#[fp16(skip)]`) or in the config",
        );
    }
    let Some(model) = ast::Model::parse(&mut cx, &memsave, item.clone()) else {
        let errors = cx.check().unwrap_or_default();
        return quote!(#item #errors);
    };
    valid::validate(&mut cx, &model);
    match cx.check() {
        None => expand::expand(&memsave, burn, &model),
        Some(errors) => {
            let fallback = fallback::fallback(&memsave, burn, &model);
            quote!(#fallback #errors)
        }
    }
}
