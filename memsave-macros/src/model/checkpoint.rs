//! Code generation for `#[memsave::model]`'s checkpointing: `CheckpointModule` (and `HasWithCp`
//! with the flag), or, for a type that cannot be checkpointed, the bound that names its fields.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::Member;

use super::ast::{Body, Field, Model, CP_FLAG, FP16_FLAG};
use super::shape::{binding, impl_header, rebuild, variant_pattern};
use crate::crate_path::Burn;

/// `CheckpointModule`, when checkpointing can be switched on: the flag set, the marked fields
/// switched in turn.
pub(super) fn checkpoint_module(
    memsave: &TokenStream,
    burn: Burn,
    model: &Model,
) -> Option<TokenStream> {
    if !model.checkpointable() {
        return Some(not_checkpointable(memsave, burn, model));
    }
    let header = impl_header(model, quote!(#memsave::checkpoint::CheckpointModule));
    // Each marked field is switched through a trait of its own, whose error names the field
    // when its type cannot be checkpointed (the generic "not implemented" could not).
    let marked = marked_fields(model);
    let via = |field: &Field| -> TokenStream {
        let index = marked
            .iter()
            .position(|(marked, _)| std::ptr::eq(*marked, field))
            .expect("every marked field is listed");
        let name = format_ident!("__MemsaveWithCpField{}", index);
        quote!(#name)
    };
    let field_traits = marked.iter().enumerate().map(|(index, (_, described))| {
        let name = format_ident!("__MemsaveWithCpField{}", index);
        let message = format!(
            "{described} is marked `#[with_cp]`, but its type `{{Self}}` cannot be \
             checkpointed: nothing in it has a `with_cp` switch"
        );
        let label = format!("{described}: `#[with_cp]` switches checkpointing on inside it");
        let note = "a checkpointable block is a `#[memsave::model]` struct with a field \
                    `with_cp: bool` and a `#[with_cp]` method (its forward); Burn's layers have \
                    no such switch: checkpoint the block that contains them, or remove \
                    `#[with_cp]` from this field";
        quote! {
            #[diagnostic::on_unimplemented(message = #message, label = #label, note = #note)]
            trait #name: Sized {
                fn set_with_cp(self, on: bool) -> Self;
                fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self;
                fn visit_segments(
                    &self,
                    path: &str,
                    visit: &mut dyn FnMut(&str, #memsave::checkpoint::SegmentId),
                );
            }

            impl<T: #memsave::checkpoint::CheckpointModule> #name for T {
                fn set_with_cp(self, on: bool) -> Self {
                    #memsave::checkpoint::CheckpointModule::set_with_cp(self, on)
                }
                fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
                    #memsave::checkpoint::CheckpointModule::set_with_cp_by_path(self, path, on)
                }
                fn visit_segments(
                    &self,
                    path: &str,
                    visit: &mut dyn FnMut(&str, #memsave::checkpoint::SegmentId),
                ) {
                    #memsave::checkpoint::CheckpointModule::visit_segments(self, path, visit)
                }
            }
        }
    });
    let body = rebuild(model, &|field, value| {
        if field.ident().is_some_and(|ident| ident == CP_FLAG) && model.cp_flag().is_some() {
            quote!(on)
        } else if field.with_cp.is_some() {
            // Spanned on the field's type: a type without a switch is reported there.
            let via = via(field);
            quote_spanned! {field.ty.span()=>
                #via::set_with_cp(#value, on)
            }
        } else {
            value
        }
    });
    // A segment itself (the flag, or an enum dispatching to blocks), or a container.
    let mark = if model.cp_flag().is_some() || matches!(model.body, Body::Enum(_)) {
        quote!(Marked)
    } else {
        quote!(Unmarked)
    };
    let mark = mark_path(memsave, burn, mark);
    // A marked field's path: the struct's path and the field's name; an enum's variant adds
    // nothing (as in PyTorch's module paths).
    let sub_path = |field: &Field| {
        if matches!(model.body, Body::Enum(_)) {
            quote!(path)
        } else {
            let name = field_name(field);
            quote!(&#memsave::checkpoint::__private::join_path(path, #name))
        }
    };
    // Per path: the flag set by `on(path)`, the marked fields switched below their names.
    let by_path = rebuild(model, &|field, value| {
        if field.ident().is_some_and(|ident| ident == CP_FLAG) && model.cp_flag().is_some() {
            quote!(on(path))
        } else if field.with_cp.is_some() {
            let path = sub_path(field);
            let via = via(field);
            quote_spanned! {field.ty.span()=>
                #via::set_with_cp_by_path(#value, #path, on)
            }
        } else {
            value
        }
    });
    let visits = visit_marked(model, &|field, value| {
        let path = sub_path(field);
        let via = via(field);
        quote_spanned! {field.ty.span()=>
            #via::visit_segments(#value, #path, visit);
        }
    });
    let own = model
        .cp_flag()
        .map(|_| quote!(visit(path, #memsave::checkpoint::SegmentId::of(self));));
    Some(quote! {
        const _: () = {
            #(#field_traits)*

            #header {
                type Mark = #mark;

                fn set_with_cp(self, on: bool) -> Self {
                    #body
                }

                #[allow(unused_variables)]
                fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
                    #by_path
                }

                #[allow(unused_variables)]
                fn visit_segments(
                    &self,
                    path: &str,
                    visit: &mut dyn FnMut(&str, #memsave::checkpoint::SegmentId),
                ) {
                    #own
                    #visits
                }
            }
        };
    })
}

/// The fields marked `#[with_cp]`, each with its name in words (`field `head` of `Net``).
fn marked_fields(model: &Model) -> Vec<(&Field, String)> {
    let name = &model.ident;
    match &model.body {
        Body::Struct(fields) => fields
            .iter()
            .filter(|field| field.with_cp.is_some())
            .map(|field| (field, format!("field `{}` of `{name}`", field_name(field))))
            .collect(),
        Body::Enum(variants) => variants
            .iter()
            .flat_map(|variant| {
                variant
                    .fields
                    .iter()
                    .filter(|field| field.with_cp.is_some())
                    .map(move |field| {
                        (
                            field,
                            format!(
                                "field `{}` of `{name}::{}`",
                                field_name(field),
                                variant.ident
                            ),
                        )
                    })
            })
            .collect(),
    }
}

/// Without a flag or a marked field, `CheckpointModule` holds only where a trait of this type's
/// own holds, and none does: switching checkpointing on in it (`set_with_cp(model, true)`, or a
/// parent's `#[with_cp]` field of this type) is an error that names its fields, one of which
/// should be marked `#[with_cp]`, instead of Burn's generic "not implemented".
fn not_checkpointable(memsave: &TokenStream, burn: Burn, model: &Model) -> TokenStream {
    let name = &model.ident;
    let vis = match &model.item {
        syn::Item::Struct(item) => &item.vis,
        syn::Item::Enum(item) => &item.vis,
        _ => return TokenStream::new(),
    };
    let guard = format_ident!("__MemsaveNoWithCpField{}", name);
    let fields: Vec<String> = match &model.body {
        Body::Struct(fields) => fields
            .iter()
            .filter(|field| {
                !field.module_skip
                    && !field
                        .ident()
                        .is_some_and(|ident| ident == CP_FLAG || ident == FP16_FLAG)
            })
            .map(|field| format!("`{}`", field_name(field)))
            .collect(),
        Body::Enum(variants) => variants
            .iter()
            .filter(|variant| !variant.fields.is_empty())
            .map(|variant| format!("the field of `{}::{}`", name, variant.ident))
            .collect(),
    };
    let candidates = if fields.is_empty() {
        "it has no field that could hold one".to_string()
    } else {
        format!("one of {}", fields.join(", "))
    };
    let message = format!(
        "`{name}` has no field marked `#[with_cp]` and no `with_cp` flag, so checkpointing cannot \
         be switched on in it"
    );
    let label = format!("checkpointing is switched on in a `{name}` here");
    let note = format!(
        "mark the field of `{name}` that holds the blocks to recompute with `#[with_cp]` \
         ({candidates}); a block is a `#[memsave::model]` struct with a field `with_cp: bool` \
         and a `#[with_cp]` method"
    );
    let (impl_generics, ty_generics, where_clause) = model.generics.split_for_impl();
    let mut predicates: Vec<TokenStream> = where_clause
        .map(|clause| clause.predicates.iter().map(|p| quote!(#p)).collect())
        .unwrap_or_default();
    // Higher-ranked, so that it is not rejected as trivially false on a type without generics.
    // On a type other than the model's own, so that the compiler reports this bound's message
    // (rather than `CheckpointModule`'s, whose self type is the model).
    predicates.push(quote! {
        for<'__memsave> #memsave::checkpoint::__private::FieldsOf<#name #ty_generics>: #guard
    });
    let unmarked = unmarked(memsave, burn);
    quote! {
        #[doc(hidden)]
        #[allow(non_camel_case_types)]
        #[diagnostic::on_unimplemented(message = #message, label = #label, note = #note)]
        #vis trait #guard {}

        impl #impl_generics #memsave::checkpoint::CheckpointModule for #name #ty_generics
        where #(#predicates),*
        {
            type Mark = #unmarked;

            fn set_with_cp(self, _on: bool) -> Self {
                self
            }
        }
    }
}

/// Where `CheckpointModule::Mark`'s answers live: beside fp16's first-layer guard on Burn 0.21,
/// in `checkpoint` on 0.22 (no fp16 there yet).
fn mark_path(memsave: &TokenStream, burn: Burn, mark: TokenStream) -> TokenStream {
    match burn {
        Burn::V0_21 => quote!(#memsave::fp16::__private::#mark),
        Burn::V0_22 => quote!(#memsave::checkpoint::__private::#mark),
    }
}

/// `Unmarked`, where the runtime has it.
pub(super) fn unmarked(memsave: &TokenStream, burn: Burn) -> TokenStream {
    mark_path(memsave, burn, quote!(Unmarked))
}

/// A struct field's name in a module path: its name, or its position in a tuple struct.
fn field_name(field: &Field) -> String {
    match &field.member {
        Member::Named(ident) => ident.to_string(),
        Member::Unnamed(index) => index.index.to_string(),
    }
}

/// Statements calling `each` on a reference to every field marked `#[with_cp]`, through a
/// `match` for an enum.
fn visit_marked(model: &Model, each: &dyn Fn(&Field, TokenStream) -> TokenStream) -> TokenStream {
    match &model.body {
        Body::Struct(fields) => {
            let calls = fields
                .iter()
                .filter(|field| field.with_cp.is_some())
                .map(|field| {
                    let member = &field.member;
                    each(field, quote_spanned!(field.ty.span()=> &self.#member))
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
                    .filter(|(field, _)| field.with_cp.is_some())
                    .map(|(field, bound)| each(field, quote!(#bound)));
                let pattern = variant_pattern(variant, &bindings);
                quote!(#pattern => { #(#calls)* })
            });
            quote!(match self { #(#arms,)* })
        }
    }
}

/// `HasWithCp`, when the struct has the flag.
pub(super) fn has_with_cp(memsave: &TokenStream, model: &Model) -> Option<TokenStream> {
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
