//! Code generation for `#[memsave::model]`: `Fp16Module` (and `HasFp16Flag` with the flag),
//! `CheckpointModule` (and `HasWithCp` with the flag), for a struct or an enum of modules.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;

use super::ast::{Body, Field, Model, CP_FLAG, FP16_FLAG};
use super::shape::{binding, impl_header, rebuild, variant_pattern};
use crate::crate_path::Burn;

pub fn expand(memsave: &TokenStream, burn: Burn, model: &Model) -> TokenStream {
    let item = &model.item;
    let checkpoint_module = super::checkpoint::checkpoint_module(memsave, burn, model);
    let has_with_cp = super::checkpoint::has_with_cp(memsave, model);
    let fp16_module = fp16_module(memsave, model);
    let has_flag = has_fp16_flag(memsave, model);
    // On Burn 0.22 the runtime replays the draws of Burn's own random layers: no probe of a
    // module's draws and no guard against Burn's `Dropout` in a segment there.
    let v0_21 = burn == Burn::V0_21;
    let random_draws = v0_21.then(|| random_draws(memsave, model));
    let marks = marks(memsave, model);
    let segment_safe = v0_21.then(|| segment_safe(memsave, model)).flatten();
    quote! {
        #item
        #fp16_module
        #has_flag
        #checkpoint_module
        #has_with_cp
        #random_draws
        #marks
        #segment_safe
    }
}

/// `Fp16Module`: the flag switched on, every other field wrapped in turn.
///
/// With the fp16 flag, every field must take part: a field that cannot is an error at the
/// field. Without it (a block with only `with_cp`, or none), the impl holds where its fields
/// take part, so that the struct compiles whatever its layers, and only `wrap_fp16_model` on a
/// model holding it asks for more. (The bounds are higher-ranked so that a false one on a
/// concrete type, `LocalResponseNorm: Fp16Module`, is not rejected as trivially false.)
fn fp16_module(memsave: &TokenStream, model: &Model) -> TokenStream {
    let header = if model.flag().is_some() {
        impl_header(model, quote!(#memsave::fp16::Fp16Module))
    } else {
        let (impl_generics, ty_generics, where_clause) = model.generics.split_for_impl();
        let name = &model.ident;
        let mut predicates: Vec<TokenStream> = where_clause
            .map(|clause| clause.predicates.iter().map(|p| quote!(#p)).collect())
            .unwrap_or_default();
        let mut seen = Vec::new();
        for field in model.all_fields() {
            let wrapped = !field.fp16_skip
                && !field
                    .ident()
                    .is_some_and(|ident| ident == CP_FLAG || ident == FP16_FLAG);
            let ty = &field.ty;
            let key = quote!(#ty).to_string();
            if wrapped && !seen.contains(&key) {
                predicates.push(quote!(for<'__memsave> #ty: #memsave::fp16::Fp16Module));
                seen.push(key);
            }
        }
        quote! {
            impl #impl_generics #memsave::fp16::Fp16Module for #name #ty_generics
            where #(#predicates),*
        }
    };
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
    let visits = visit_flags(memsave, model);
    quote! {
        #header {
            fn wrap_fp16(self, precision: #memsave::fp16::Precision) -> Self {
                #body
            }

            #visits
        }
    }
}

/// `Fp16Module::visit_with_cp_flags`: this module's `with_cp` flag, then every field that
/// `wrap_fp16` reaches, in turn (what the first step's check of the switches reads).
fn visit_flags(memsave: &TokenStream, model: &Model) -> TokenStream {
    let wrapped = |field: &Field| {
        !field.fp16_skip
            && !field
                .ident()
                .is_some_and(|ident| ident == CP_FLAG || ident == FP16_FLAG)
    };
    let call = |value: TokenStream| {
        quote! {
            #memsave::fp16::Fp16Module::visit_with_cp_flags(#value, visit);
        }
    };
    let own = model.cp_flag().map(|_| {
        quote! {
            visit(
                #memsave::checkpoint::SegmentId::of(self),
                #memsave::checkpoint::HasWithCp::with_cp(self),
            );
        }
    });
    let fields = match &model.body {
        Body::Struct(fields) => {
            let calls = fields.iter().filter(|field| wrapped(field)).map(|field| {
                let member = &field.member;
                call(quote_spanned!(field.ty.span()=> &self.#member))
            });
            quote!(#(#calls)*)
        }
        Body::Enum(variants) => {
            let arms = variants.iter().map(|variant| {
                let bindings: Vec<_> = variant.fields.iter().map(binding).collect();
                let calls = variant
                    .fields
                    .iter()
                    .zip(&bindings)
                    .filter(|(field, _)| wrapped(field))
                    .map(|(_, bound)| call(quote!(#bound)));
                let pattern = variant_pattern(variant, &bindings);
                quote!(#pattern => { #(#calls)* })
            });
            quote!(match self { #(#arms,)* })
        }
    };
    quote! {
        #[allow(unused_variables)]
        fn visit_with_cp_flags(
            &self,
            visit: &mut dyn FnMut(#memsave::checkpoint::SegmentId, bool),
        ) {
            #own
            #fields
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

/// `RandomDraws`: true if a field draws from the backend's random stream (fields whose type
/// says nothing count as not drawing).
fn random_draws(memsave: &TokenStream, model: &Model) -> TokenStream {
    let header = impl_header(model, quote!(#memsave::checkpoint::RandomDraws));
    let probe = |value: TokenStream| {
        quote! {
            (&#memsave::checkpoint::__private::Probe(#value)).draws_random()
        }
    };
    let body = match &model.body {
        Body::Struct(fields) => {
            let checks = fields
                .iter()
                .filter(|field| !field.module_skip)
                .map(|field| {
                    let member = &field.member;
                    probe(quote!(&self.#member))
                });
            quote!(false #(|| #checks)*)
        }
        Body::Enum(variants) => {
            let arms = variants.iter().map(|variant| {
                let bindings: Vec<_> = variant.fields.iter().map(binding).collect();
                let checks = variant
                    .fields
                    .iter()
                    .zip(&bindings)
                    .filter(|(field, _)| !field.module_skip)
                    .map(|(_, bound)| probe(quote!(#bound)));
                let pattern = variant_pattern(variant, &bindings);
                quote!(#pattern => false #(|| #checks)*)
            });
            quote!(match self { #(#arms,)* })
        }
    };
    quote! {
        #header {
            #[allow(unused_variables)]
            fn draws_random(&self) -> bool {
                #[allow(unused_imports)]
                use #memsave::checkpoint::__private::{ViaFallback as _, ViaTrait as _};
                #body
            }
        }
    }
}

/// Per field marked `#[with_cp]`, a hidden method `__memsave_mark_FIELD` returning `Marked`:
/// `#[auto_fp16]` asks it of a field that receives the forward's own input (a field without one
/// answers `Unmarked` through the method macro's fallback), together with the field type's
/// `CheckpointModule::Mark` (`Unmarked` for a container of segments, such as a backbone whose
/// stem runs plainly), a type-checked, so pre-monomorphisation, question.
fn marks(memsave: &TokenStream, model: &Model) -> Option<TokenStream> {
    let Body::Struct(fields) = &model.body else {
        return None;
    };
    let (impl_generics, ty_generics, where_clause) = model.generics.split_for_impl();
    let name = &model.ident;
    let marks: Vec<TokenStream> = fields
        .iter()
        .filter(|field| field.with_cp.is_some())
        .filter_map(|field| {
            let method = format_ident!("__memsave_mark_{}", field.ident()?);
            Some(quote! {
                #[doc(hidden)]
                #[allow(dead_code)]
                pub fn #method(&self) -> #memsave::fp16::__private::Marked {
                    #memsave::fp16::__private::Marked
                }
            })
        })
        .collect();
    (!marks.is_empty()).then(|| {
        quote! {
            impl #impl_generics #name #ty_generics #where_clause {
                #(#marks)*
            }
        }
    })
}

/// Burn 0.21: with the `with_cp` flag, a constant per field whose type names no generic
/// parameter: its evaluation fails, naming memsave's replacement, if the field is a layer that a
/// checkpointed segment would get wrong (Burn's `Dropout` and `GaussianNoise`, whose
/// recomputation would draw anew). Generic field types cannot be those layers.
fn segment_safe(memsave: &TokenStream, model: &Model) -> Option<TokenStream> {
    let Body::Struct(fields) = &model.body else {
        return None;
    };
    model.cp_flag()?;
    let generic_names: Vec<String> = model
        .generics
        .params
        .iter()
        .filter_map(|param| match param {
            syn::GenericParam::Type(param) => Some(param.ident.to_string()),
            syn::GenericParam::Const(param) => Some(param.ident.to_string()),
            syn::GenericParam::Lifetime(_) => None,
        })
        .chain(std::iter::once("Self".to_string()))
        .collect();
    let checks = fields
        .iter()
        .filter(|field| {
            let ty = &field.ty;
            !mentions(&quote!(#ty), &generic_names)
        })
        .map(|field| {
            let ty = &field.ty;
            quote_spanned! {ty.span()=>
                const _: () = {
                    #[allow(unused_imports)]
                    use #memsave::checkpoint::__private::SegmentFallback as _;
                    let message = #memsave::checkpoint::__private::SegmentProbe::<#ty>::UNSAFE_IN_SEGMENT;
                    if !message.is_empty() {
                        ::core::panic!("{}", message);
                    }
                };
            }
        });
    Some(quote!(#(#checks)*))
}

/// Whether `tokens` name one of `names` (a generic parameter, or `Self`).
fn mentions(tokens: &TokenStream, names: &[String]) -> bool {
    tokens.clone().into_iter().any(|tree| match tree {
        proc_macro2::TokenTree::Ident(ident) => names.iter().any(|name| ident == name),
        proc_macro2::TokenTree::Group(group) => mentions(&group.stream(), names),
        _ => false,
    })
}
