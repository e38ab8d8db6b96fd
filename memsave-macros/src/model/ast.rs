//! The typed model of a `#[memsave::model]` item: a struct, or an enum of modules.

use proc_macro2::{Span, TokenStream};
use syn::spanned::Spanned;
use syn::{Fields, Generics, Ident, Item, Member, Type};

use crate::ctxt::Ctxt;
use crate::suggest;

/// The name of the fp16 flag field.
pub const FP16_FLAG: &str = "fp16_enabled";
/// The name of the checkpointing flag field.
pub const CP_FLAG: &str = "with_cp";

pub struct Model {
    /// The item as it is emitted: memsave's field attributes removed.
    pub item: Item,
    pub ident: Ident,
    pub generics: Generics,
    pub body: Body,
}

pub enum Body {
    /// A struct with named fields.
    Struct(Vec<Field>),
    /// An enum: one module per variant, usually (`Block::{Basic, Bottleneck}`).
    Enum(Vec<Variant>),
}

pub struct Variant {
    pub ident: Ident,
    pub style: Style,
    pub fields: Vec<Field>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Named,
    Unnamed,
    Unit,
}

pub struct Field {
    /// The field's name, or its position in a tuple variant.
    pub member: Member,
    /// The field's type as emitted (`Fp32<T>` for an island).
    pub ty: Type,
    /// `#[fp16(skip)]` or `#[module(skip)]`: left as it is by `wrap_fp16_model`.
    pub fp16_skip: bool,
    /// `#[fp16(fp32)]`: the attribute, when the field is an fp32 island.
    pub fp32: Option<syn::Attribute>,
    /// `#[module(skip)]`: not a module of Burn's.
    pub module_skip: bool,
    /// `#[with_cp]`: the attribute, when the field is marked for checkpointing.
    pub with_cp: Option<syn::Attribute>,
}

impl Field {
    /// The field's name, for named fields.
    pub fn ident(&self) -> Option<&Ident> {
        match &self.member {
            Member::Named(ident) => Some(ident),
            Member::Unnamed(_) => None,
        }
    }

    fn is(&self, name: &str) -> bool {
        self.ident().is_some_and(|ident| ident == name)
    }
}

impl Model {
    pub fn parse(cx: &mut Ctxt, memsave: &TokenStream, tokens: TokenStream) -> Option<Model> {
        let mut item: Item = match syn::parse2(tokens) {
            Ok(item @ (Item::Struct(_) | Item::Enum(_))) => item,
            _ => {
                cx.syn_error(syn::Error::new(
                    Span::call_site(),
                    "`#[memsave::model]` goes on a struct with named fields or on an enum (a Burn \
                     module)",
                ));
                return None;
            }
        };
        let body = match &mut item {
            Item::Struct(item) => {
                let Fields::Named(named) = &mut item.fields else {
                    cx.error_spanned_by(
                        &item.ident,
                        "`#[memsave::model]` needs named fields: the generated code reaches each \
                         submodule by its name",
                    );
                    return None;
                };
                Body::Struct(parse_fields(cx, memsave, named.named.iter_mut()))
            }
            Item::Enum(item) => Body::Enum(
                item.variants
                    .iter_mut()
                    .map(|variant| {
                        let style = match &variant.fields {
                            Fields::Named(_) => Style::Named,
                            Fields::Unnamed(_) => Style::Unnamed,
                            Fields::Unit => Style::Unit,
                        };
                        Variant {
                            ident: variant.ident.clone(),
                            style,
                            fields: parse_fields(cx, memsave, variant.fields.iter_mut()),
                        }
                    })
                    .collect(),
            ),
            _ => unreachable!("matched above"),
        };
        let (ident, generics) = match &item {
            Item::Struct(item) => (item.ident.clone(), item.generics.clone()),
            Item::Enum(item) => (item.ident.clone(), item.generics.clone()),
            _ => unreachable!("matched above"),
        };
        Some(Model {
            item,
            ident,
            generics,
            body,
        })
    }

    /// The struct's fields (none for an enum).
    pub fn fields(&self) -> &[Field] {
        match &self.body {
            Body::Struct(fields) => fields,
            Body::Enum(_) => &[],
        }
    }

    /// The `fp16_enabled` field, if the struct has one.
    pub fn flag(&self) -> Option<&Field> {
        self.fields().iter().find(|field| field.is(FP16_FLAG))
    }

    /// The `with_cp` field, if the struct has one.
    pub fn cp_flag(&self) -> Option<&Field> {
        self.fields().iter().find(|field| field.is(CP_FLAG))
    }

    /// Whether checkpointing can be switched on in this item: a flag, or a marked field.
    pub fn checkpointable(&self) -> bool {
        match &self.body {
            Body::Struct(fields) => {
                self.cp_flag().is_some() || fields.iter().any(|field| field.with_cp.is_some())
            }
            Body::Enum(variants) => variants
                .iter()
                .any(|variant| variant.fields.iter().any(|field| field.with_cp.is_some())),
        }
    }

    /// Every field, of the struct or of every variant.
    pub fn all_fields(&self) -> Box<dyn Iterator<Item = &Field> + '_> {
        match &self.body {
            Body::Struct(fields) => Box::new(fields.iter()),
            Body::Enum(variants) => Box::new(variants.iter().flat_map(|variant| &variant.fields)),
        }
    }
}

fn parse_fields<'a>(
    cx: &mut Ctxt,
    memsave: &TokenStream,
    fields: impl Iterator<Item = &'a mut syn::Field>,
) -> Vec<Field> {
    let mut out = Vec::new();
    for (index, field) in fields.enumerate() {
        let member = match &field.ident {
            Some(ident) => Member::Named(ident.clone()),
            None => Member::Unnamed(index.into()),
        };
        let mut fp16_skip = false;
        let mut fp32 = None;
        let mut module_skip = false;
        let mut with_cp = None;
        field.attrs.retain(|attr| {
            let path = attr.path();
            if path.is_ident("fp16") {
                match parse_fp16_attr(cx, attr) {
                    Some(Fp16Option::Skip) => fp16_skip = true,
                    Some(Fp16Option::Fp32) => fp32 = Some(attr.clone()),
                    None => {}
                }
                false
            } else if is_with_cp(path) {
                if !matches!(attr.meta, syn::Meta::Path(_)) {
                    cx.error_spanned_by(
                        attr,
                        "`#[with_cp]` on a field takes no options: it marks the block(s) that \
                         `set_with_cp` switches checkpointing on in",
                    );
                }
                with_cp = Some(attr.clone());
                false
            } else {
                if path.is_ident("module") && mentions_skip(attr) {
                    module_skip = true;
                }
                true
            }
        });
        if fp32.is_some() && !module_skip {
            // The island: `T` becomes `Fp32<T>`, spanned on the type as written.
            let ty = &field.ty;
            field.ty = syn::parse_quote_spanned!(ty.span()=> #memsave::fp16::Fp32<#ty>);
        }
        out.push(Field {
            member,
            ty: field.ty.clone(),
            fp16_skip: fp16_skip || module_skip,
            fp32,
            module_skip,
            with_cp,
        });
    }
    out
}

/// `#[with_cp]` or `#[memsave::with_cp]`.
fn is_with_cp(path: &syn::Path) -> bool {
    path.segments
        .last()
        .is_some_and(|segment| segment.ident == "with_cp")
        && (path.segments.len() == 1 || path.segments[0].ident == "memsave")
}

/// The options of `#[fp16(...)]` on a field.
enum Fp16Option {
    /// Left exactly as it is: not cast, its inputs not cast either.
    Skip,
    /// An fp32 island: kept fp32, its inputs cast to fp32 and its outputs back.
    Fp32,
}

/// `#[fp16(skip)]` or `#[fp16(fp32)]`; anything else is an error.
fn parse_fp16_attr(cx: &mut Ctxt, attr: &syn::Attribute) -> Option<Fp16Option> {
    const OPTIONS: &[&str] = &["fp32", "skip"];
    let mut found = None;
    let result = attr.parse_nested_meta(|meta| {
        let option = if meta.path.is_ident("skip") {
            Fp16Option::Skip
        } else if meta.path.is_ident("fp32") {
            Fp16Option::Fp32
        } else {
            let name = meta
                .path
                .get_ident()
                .map(ToString::to_string)
                .unwrap_or_default();
            let hint = match suggest::closest(&name, OPTIONS) {
                Some(close) => format!("did you mean `{close}`?"),
                None => "the options are `fp32` (keep the layer in fp32, its inputs cast to fp32 \
                         and its outputs back) and `skip` (leave the field exactly as it is)"
                    .to_string(),
            };
            return Err(meta.error(format!("unknown option `{name}` in `#[fp16(...)]`; {hint}")));
        };
        if found.is_some() {
            return Err(meta.error(
                "`#[fp16(...)]` takes one option: `fp32` (an fp32 island) or `skip` (left as it is)",
            ));
        }
        found = Some(option);
        Ok(())
    });
    if let Err(error) = result {
        cx.syn_error(error);
    }
    found
}

/// Whether `#[module(...)]` contains `skip`.
fn mentions_skip(attr: &syn::Attribute) -> bool {
    let mut skip = false;
    let _ = attr.parse_nested_meta(|meta| {
        if meta.path.is_ident("skip") {
            skip = true;
        }
        if meta.input.peek(syn::Token![=]) {
            let _: syn::Expr = meta.value()?.parse()?;
        }
        Ok(())
    });
    skip
}
