//! Code generation for `#[with_cp]` on a method.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::{FnArg, ImplItemFn};

use super::valid::Plan;

/// `fn forward(&self, x) -> y { body }` becomes a dispatcher `forward`, which runs the body
/// under `checkpoint` when `self.with_cp` is on (and `x` requires grad), and the body itself as
/// a hidden method `__forward_segment`.
pub fn expand(memsave: &TokenStream, plan: &Plan, method: ImplItemFn) -> TokenStream {
    let name = &method.sig.ident;
    let segment_name = format_ident!("__{}_segment", name);

    // The segment: the method as written, renamed, private and hidden.
    let mut segment = method.clone();
    segment.sig.ident = segment_name.clone();
    segment.vis = syn::Visibility::Inherited;
    segment.attrs = vec![syn::parse_quote!(#[doc(hidden)])];

    // The dispatcher keeps the name, the attributes and the signature (patterns renamed).
    let mut dispatcher = method;
    let names: Vec<syn::Ident> = plan
        .args
        .iter()
        .enumerate()
        .map(|(index, name)| {
            name.clone()
                .unwrap_or_else(|| format_ident!("__arg{}", index, span = Span::mixed_site()))
        })
        .collect();
    let mut typed = dispatcher
        .sig
        .inputs
        .iter_mut()
        .filter_map(|arg| match arg {
            FnArg::Typed(arg) => Some(arg),
            FnArg::Receiver(_) => None,
        });
    for name in &names {
        let arg = typed.next().expect("one name per typed argument");
        if !matches!(&*arg.pat, syn::Pat::Ident(_)) {
            *arg.pat = syn::parse_quote!(#name);
        }
    }
    // Without `mut`: the dispatcher only passes its arguments on.
    for arg in dispatcher.sig.inputs.iter_mut() {
        if let FnArg::Typed(arg) = arg {
            if let syn::Pat::Ident(ident) = &mut *arg.pat {
                ident.mutability = None;
            }
        }
    }

    let (input, pattern) = match names.as_slice() {
        [single] => (quote!(#single), quote!(#single)),
        many => (quote!((#(#many),*)), quote!((#(#many),*))),
    };
    dispatcher.block = syn::parse_quote!({
        if #memsave::checkpoint::HasWithCp::with_cp(self) {
            #memsave::checkpoint::checkpoint(self, #input, |this: &Self, #pattern| {
                this.#segment_name(#(#names),*)
            })
        } else {
            self.#segment_name(#(#names),*)
        }
    });
    quote! {
        #dispatcher
        #segment
    }
}
