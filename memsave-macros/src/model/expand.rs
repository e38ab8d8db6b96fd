//! Code generation for `#[memsave::model]`: `Fp16Module` (and `HasFp16Flag` with the flag),
//! `CheckpointModule` (and `HasWithCp` with the flag), for a struct or an enum of modules.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::Member;

use super::ast::{Body, Field, Model, Style, CP_FLAG, FP16_FLAG};

pub fn expand(memsave: &TokenStream, model: &Model) -> TokenStream {
    let item = &model.item;
    let fp16_module = fp16_module(memsave, model);
    let has_flag = has_fp16_flag(memsave, model);
    let checkpoint_module = checkpoint_module(memsave, model);
    let has_with_cp = has_with_cp(memsave, model);
    quote! {
        #item
        #fp16_module
        #has_flag
        #checkpoint_module
        #has_with_cp
    }
}

fn impl_header(model: &Model, trait_path: TokenStream) -> TokenStream {
    let (impl_generics, ty_generics, where_clause) = model.generics.split_for_impl();
    let name = &model.ident;
    quote!(impl #impl_generics #trait_path for #name #ty_generics #where_clause)
}

/// A binding for a field in a match arm: its name, or `__fieldN` for a tuple field.
fn binding(field: &Field) -> syn::Ident {
    match &field.member {
        Member::Named(ident) => ident.clone(),
        Member::Unnamed(index) => {
            format_ident!("__field{}", index.index, span = field.ty.span())
        }
    }
}

/// `match self { Self::V(a, b) => Self::V(f(a), b), ... }` for an enum, `Self { a: f(self.a) }`
/// for a struct, with `each` giving a field's new value from its expression.
fn rebuild(model: &Model, each: &dyn Fn(&Field, TokenStream) -> TokenStream) -> TokenStream {
    match &model.body {
        Body::Struct(fields) => {
            let fields = fields.iter().map(|field| {
                let member = &field.member;
                // Spanned on the field's type, so that an error about the value points there.
                let value = each(field, quote_spanned!(field.ty.span()=> self.#member));
                quote!(#member: #value)
            });
            quote!(Self { #(#fields),* })
        }
        Body::Enum(variants) => {
            let arms = variants.iter().map(|variant| {
                let name = &variant.ident;
                let bindings: Vec<_> = variant.fields.iter().map(binding).collect();
                let values = variant
                    .fields
                    .iter()
                    .zip(&bindings)
                    .map(|(field, bound)| each(field, quote!(#bound)));
                match variant.style {
                    Style::Unit => quote!(Self::#name => Self::#name),
                    Style::Unnamed => {
                        quote!(Self::#name(#(#bindings),*) => Self::#name(#(#values),*))
                    }
                    Style::Named => {
                        let members = variant.fields.iter().map(|field| &field.member);
                        quote!(Self::#name { #(#bindings),* } => Self::#name { #(#members: #values),* })
                    }
                }
            });
            quote!(match self { #(#arms,)* })
        }
    }
}

/// `Fp16Module`: the flag switched on, every other field wrapped in turn.
fn fp16_module(memsave: &TokenStream, model: &Model) -> TokenStream {
    let header = impl_header(model, quote!(#memsave::fp16::Fp16Module));
    let body = rebuild(model, &|field, value| {
        if field.ident().is_some_and(|ident| ident == FP16_FLAG) && model.flag().is_some() {
            quote!(#memsave::fp16::Fp16::On(precision))
        } else if field.fp16_skip || field.ident().is_some_and(|ident| ident == CP_FLAG) {
            value
        } else {
            // Spanned on the field's type: a type that cannot take part is reported there.
            quote_spanned! {field.ty.span()=>
                #memsave::fp16::Fp16Module::wrap_fp16(#value, precision)
            }
        }
    });
    quote! {
        #header {
            fn wrap_fp16(self, precision: #memsave::fp16::Precision) -> Self {
                #body
            }
        }
    }
}

/// `HasFp16Flag`, when the struct has the flag.
fn has_fp16_flag(memsave: &TokenStream, model: &Model) -> Option<TokenStream> {
    let flag = &model.flag()?.member;
    let header = impl_header(model, quote!(#memsave::fp16::HasFp16Flag));
    Some(quote! {
        #header {
            fn fp16_enabled(&self) -> #memsave::fp16::Fp16 {
                self.#flag
            }
        }
    })
}

/// `CheckpointModule`, when checkpointing can be switched on: the flag set, the marked fields
/// switched in turn.
fn checkpoint_module(memsave: &TokenStream, model: &Model) -> Option<TokenStream> {
    if !model.checkpointable() {
        return None;
    }
    let header = impl_header(model, quote!(#memsave::checkpoint::CheckpointModule));
    let body = rebuild(model, &|field, value| {
        if field.ident().is_some_and(|ident| ident == CP_FLAG) && model.cp_flag().is_some() {
            quote!(on)
        } else if field.with_cp.is_some() {
            // Spanned on the field's type: a type without a switch is reported there.
            quote_spanned! {field.ty.span()=>
                #memsave::checkpoint::CheckpointModule::set_with_cp(#value, on)
            }
        } else {
            value
        }
    });
    Some(quote! {
        #header {
            fn set_with_cp(self, on: bool) -> Self {
                #body
            }
        }
    })
}

/// `HasWithCp`, when the struct has the flag.
fn has_with_cp(memsave: &TokenStream, model: &Model) -> Option<TokenStream> {
    let flag = &model.cp_flag()?.member;
    let header = impl_header(model, quote!(#memsave::checkpoint::HasWithCp));
    Some(quote! {
        #header {
            fn with_cp(&self) -> bool {
                self.#flag
            }
        }
    })
}
