//! The shapes of code both of `#[memsave::model]`'s impls write over a model's fields: the impl's
//! header, a field's binding, a variant's pattern, and the model rebuilt field by field.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::Member;

use super::ast::{Body, Field, Model, Style, Variant};

pub(super) fn impl_header(model: &Model, trait_path: TokenStream) -> TokenStream {
    let (impl_generics, ty_generics, where_clause) = model.generics.split_for_impl();
    let name = &model.ident;
    quote!(impl #impl_generics #trait_path for #name #ty_generics #where_clause)
}

/// A binding for a field in a match arm: its name, or `__fieldN` for a tuple field.
pub(super) fn binding(field: &Field) -> syn::Ident {
    match &field.member {
        Member::Named(ident) => ident.clone(),
        Member::Unnamed(index) => {
            format_ident!("__field{}", index.index, span = field.ty.span())
        }
    }
}

/// `Self::V`, `Self::V(a, b)` or `Self::V { x: a, y: b }`: a match pattern binding each field of
/// `variant` to its name in `bindings`.
pub(super) fn variant_pattern(variant: &Variant, bindings: &[syn::Ident]) -> TokenStream {
    let name = &variant.ident;
    match variant.style {
        Style::Unit => quote!(Self::#name),
        Style::Unnamed => quote!(Self::#name(#(#bindings),*)),
        Style::Named => {
            let members = variant.fields.iter().map(|field| &field.member);
            quote!(Self::#name { #(#members: #bindings),* })
        }
    }
}

/// `match self { Self::V(a, b) => Self::V(f(a), b), ... }` for an enum, `Self { a: f(self.a) }`
/// for a struct, with `each` giving a field's new value from its expression.
pub(super) fn rebuild(
    model: &Model,
    each: &dyn Fn(&Field, TokenStream) -> TokenStream,
) -> TokenStream {
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
