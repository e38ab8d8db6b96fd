//! Code generation for `#[memsave::model]`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::ast::{Model, FP16_FLAG};

pub fn expand(memsave: &TokenStream, model: &Model) -> TokenStream {
    let item = &model.item;
    let fp16_module = fp16_module(memsave, model, false);
    let has_flag = has_fp16_flag(memsave, model);
    quote! {
        #item
        #fp16_module
        #has_flag
    }
}

/// After an error: the struct and impls that do nothing, so that the user's other code (its
/// `#[auto_fp16]` methods, its `wrap_fp16_model` call) raises no second wave of errors.
pub fn fallback(memsave: &TokenStream, model: &Model) -> TokenStream {
    let item = &model.item;
    let fp16_module = fp16_module(memsave, model, true);
    let has_flag = model.flag().map(|_| {
        let (name, impl_generics, ty_generics, where_clause) = split(model);
        quote! {
            impl #impl_generics #memsave::fp16::HasFp16Flag for #name #ty_generics #where_clause {
                fn fp16_enabled(&self) -> #memsave::fp16::Fp16 {
                    #memsave::fp16::Fp16::Off
                }
            }
        }
    });
    quote! {
        #item
        #fp16_module
        #has_flag
    }
}

fn split(
    model: &Model,
) -> (
    &syn::Ident,
    syn::ImplGenerics<'_>,
    syn::TypeGenerics<'_>,
    Option<&syn::WhereClause>,
) {
    let (impl_generics, ty_generics, where_clause) = model.item.generics.split_for_impl();
    (&model.item.ident, impl_generics, ty_generics, where_clause)
}

/// `Fp16Module`: the flag switched on, every other field wrapped in turn.
fn fp16_module(memsave: &TokenStream, model: &Model, fallback: bool) -> TokenStream {
    let (name, impl_generics, ty_generics, where_clause) = split(model);
    let body = if fallback {
        quote!(self)
    } else {
        let fields = model.fields.iter().map(|field| {
            let ident = &field.ident;
            if ident == FP16_FLAG {
                quote!(#ident: #memsave::fp16::Fp16::On(precision))
            } else if field.fp16_skip {
                quote!(#ident: self.#ident)
            } else {
                // Spanned on the field's type: a type that cannot take part is reported there.
                let wrap = quote_spanned! {field.ty.span()=>
                    #memsave::fp16::Fp16Module::wrap_fp16(self.#ident, precision)
                };
                quote!(#ident: #wrap)
            }
        });
        quote!(Self { #(#fields),* })
    };
    let precision = if fallback {
        quote!(_precision)
    } else {
        quote!(precision)
    };
    quote! {
        impl #impl_generics #memsave::fp16::Fp16Module for #name #ty_generics #where_clause {
            fn wrap_fp16(self, #precision: #memsave::fp16::Precision) -> Self {
                #body
            }
        }
    }
}

/// `HasFp16Flag`, when the struct has the flag.
fn has_fp16_flag(memsave: &TokenStream, model: &Model) -> Option<TokenStream> {
    let flag = &model.flag()?.ident;
    let (name, impl_generics, ty_generics, where_clause) = split(model);
    Some(quote! {
        impl #impl_generics #memsave::fp16::HasFp16Flag for #name #ty_generics #where_clause {
            fn fp16_enabled(&self) -> #memsave::fp16::Fp16 {
                self.#flag
            }
        }
    })
}
