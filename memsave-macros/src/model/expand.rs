//! Code generation for `#[memsave::model]`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use super::ast::{Model, CP_FLAG, FP16_FLAG};

pub fn expand(memsave: &TokenStream, model: &Model) -> TokenStream {
    let item = &model.item;
    let fp16_module = fp16_module(memsave, model, false);
    let has_flag = has_fp16_flag(memsave, model);
    let checkpoint_module = checkpoint_module(memsave, model, false);
    let has_with_cp = has_with_cp(memsave, model, false);
    quote! {
        #item
        #fp16_module
        #has_flag
        #checkpoint_module
        #has_with_cp
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
    let checkpoint_module = checkpoint_module(memsave, model, true);
    let has_with_cp = has_with_cp(memsave, model, true);
    quote! {
        #item
        #fp16_module
        #has_flag
        #checkpoint_module
        #has_with_cp
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
            } else if field.fp16_skip || ident == CP_FLAG {
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

/// `CheckpointModule`, when checkpointing can be switched on: the flag set, the marked fields
/// switched in turn.
fn checkpoint_module(memsave: &TokenStream, model: &Model, fallback: bool) -> Option<TokenStream> {
    if !model.checkpointable() {
        return None;
    }
    let (name, impl_generics, ty_generics, where_clause) = split(model);
    let on = if fallback { quote!(_on) } else { quote!(on) };
    let body = if fallback {
        quote!(self)
    } else {
        let flag = model.cp_flag().map(|flag| {
            let ident = &flag.ident;
            quote!(#ident: on,)
        });
        let fields = model
            .fields
            .iter()
            .filter(|field| field.with_cp.is_some())
            .map(|field| {
                let ident = &field.ident;
                // Spanned on the field's type: a type without a switch is reported there.
                let switch = quote_spanned! {field.ty.span()=>
                    #memsave::checkpoint::CheckpointModule::set_with_cp(self.#ident, on)
                };
                quote!(#ident: #switch,)
            });
        quote!(Self { #flag #(#fields)* ..self })
    };
    Some(quote! {
        impl #impl_generics #memsave::checkpoint::CheckpointModule for #name #ty_generics #where_clause {
            fn set_with_cp(self, #on: bool) -> Self {
                #body
            }
        }
    })
}

/// `HasWithCp`, when the struct has the flag.
fn has_with_cp(memsave: &TokenStream, model: &Model, fallback: bool) -> Option<TokenStream> {
    let flag = &model.cp_flag()?.ident;
    let (name, impl_generics, ty_generics, where_clause) = split(model);
    let body = if fallback {
        quote!(false)
    } else {
        quote!(self.#flag)
    };
    Some(quote! {
        impl #impl_generics #memsave::checkpoint::HasWithCp for #name #ty_generics #where_clause {
            fn with_cp(&self) -> bool {
                #body
            }
        }
    })
}
