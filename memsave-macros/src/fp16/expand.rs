//! Code generation for `#[auto_fp16]` and `#[force_fp32]`.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ImplItemFn, ReturnType, Type};

use super::attr::Kind;
use super::valid::{ArgCast, Plan};

/// Rewrites `method` so that its arguments (and output, if asked) are cast when the module's
/// `fp16_enabled` flag is on.
pub fn expand(
    memsave: &TokenStream,
    kind: Kind,
    plan: &Plan,
    guards: &[TokenStream],
    mut method: ImplItemFn,
) -> TokenStream {
    let flag = format_ident!("__fp16", span = Span::mixed_site());
    let (cast_in, cast_out) = match kind {
        Kind::AutoFp16 => (quote!(to_half), quote!(to_fp32)),
        Kind::ForceFp32 => (quote!(to_fp32), quote!(to_half)),
    };

    let receiver = method
        .sig
        .receiver()
        .expect("validated: the method has a receiver");
    let by_value = matches!(&*receiver.ty, Type::Path(path) if path.path.is_ident("Self"));
    let this = if by_value {
        quote!(&self)
    } else {
        quote!(&*self)
    };
    let read_flag = quote_spanned! {method.sig.ident.span()=>
        let #flag = #memsave::fp16::HasFp16Flag::fp16_enabled(#this);
    };

    let mut lets = Vec::new();
    for cast in &plan.casts {
        lets.push(match cast {
            ArgCast::Value { ident, mutable } => {
                let mutability = mutable.then(|| quote!(mut));
                quote_spanned!(ident.span()=> let #mutability #ident = #flag.#cast_in(#ident);)
            }
            ArgCast::Borrowed { ident } => quote_spanned! {ident.span()=>
                let #ident = &#flag.#cast_in(::core::clone::Clone::clone(#ident));
            },
            ArgCast::Pattern { index } => {
                let renamed = format_ident!("__arg{}", index, span = Span::mixed_site());
                let arg = crate::args::typed_mut(&mut method.sig)
                    .nth(*index)
                    .expect("validated: the pattern's index is in range");
                let pattern = std::mem::replace(&mut *arg.pat, syn::parse_quote!(#renamed));
                quote_spanned!(pattern.span()=> let #pattern = #flag.#cast_in(#renamed);)
            }
        });
    }

    let block = &method.block;
    let body = if plan.out {
        let output = format_ident!("__output", span = Span::mixed_site());
        // The body runs in a closure so that an early `return` is cast too.
        let closure = match &method.sig.output {
            ReturnType::Type(_, ty) if !matches!(**ty, Type::ImplTrait(_)) => {
                quote!(move || -> #ty #block)
            }
            ReturnType::Type(..) => quote!(move || #block),
            ReturnType::Default => quote!(move || -> () #block),
        };
        quote! {
            #(#guards)*
            #read_flag
            #(#lets)*
            let #output = (#closure)();
            #flag.#cast_out(#output)
        }
    } else {
        let stmts = &block.stmts;
        quote! {
            #(#guards)*
            #read_flag
            #(#lets)*
            #(#stmts)*
        }
    };
    method.block = syn::parse_quote!({ #body });
    quote!(#method)
}
