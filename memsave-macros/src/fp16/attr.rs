//! Parsing of `#[auto_fp16(...)]` and `#[force_fp32(...)]` options.

use proc_macro2::TokenStream;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, Meta, Token};

use crate::ctxt::Ctxt;
use crate::suggest;

/// Which of the two cast attributes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `#[auto_fp16]`: fp32 -> half on the way in, optionally half -> fp32 on the way out.
    AutoFp16,
    /// `#[force_fp32]`: half -> fp32 on the way in, optionally fp32 -> half on the way out.
    ForceFp32,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::AutoFp16 => "auto_fp16",
            Kind::ForceFp32 => "force_fp32",
        }
    }

    /// The other attribute, which cannot share a method with this one.
    pub fn other(self) -> Kind {
        match self {
            Kind::AutoFp16 => Kind::ForceFp32,
            Kind::ForceFp32 => Kind::AutoFp16,
        }
    }

    /// The option that casts the output back.
    pub fn out_option(self) -> &'static str {
        match self {
            Kind::AutoFp16 => "out_fp32",
            Kind::ForceFp32 => "out_fp16",
        }
    }

    fn options(self) -> [&'static str; 3] {
        ["apply_to", "args", self.out_option()]
    }
}

/// The parsed options.
pub struct CastAttr {
    /// The arguments to cast; `None`: every argument taken by value.
    pub args: Option<Vec<Ident>>,
    /// Cast the output back (`out_fp32` / `out_fp16`).
    pub out: bool,
}

/// Parses the attribute's tokens, recording every mistake in `cx`.
pub fn parse(cx: &mut Ctxt, kind: Kind, tokens: TokenStream) -> CastAttr {
    let mut attr = CastAttr {
        args: None,
        out: false,
    };
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(tokens) {
        Ok(metas) => metas,
        Err(error) => {
            cx.syn_error(error);
            return attr;
        }
    };

    let mut args_key: Option<Ident> = None;
    let mut out_key: Option<Ident> = None;
    for meta in metas {
        let Some(key) = meta.path().get_ident().cloned() else {
            cx.error_spanned_by(meta.path(), unknown_option(kind, "this path"));
            continue;
        };
        let name = key.to_string();
        if name == "apply_to" || name == "args" {
            if let Some(previous) = &args_key {
                let message = if *previous == key {
                    format!("`{name}` is given twice")
                } else {
                    "`args` and `apply_to` are the same option (`apply_to` is MMCV's name for \
                     `auto_fp16`, `args` for `force_fp32`): give only one"
                        .to_string()
                };
                cx.error_spanned_by(&key, message);
                continue;
            }
            args_key = Some(key.clone());
            attr.args = parse_names(cx, &name, &meta);
        } else if name == kind.out_option() {
            if out_key.is_some() {
                cx.error_spanned_by(&key, format!("`{name}` is given twice"));
                continue;
            }
            out_key = Some(key.clone());
            attr.out = parse_flag(cx, &name, &meta);
        } else {
            cx.error_spanned_by(&key, unknown_option(kind, &format!("`{name}`")));
        }
    }
    attr
}

fn unknown_option(kind: Kind, what: &str) -> String {
    let options = kind.options();
    let mut message = format!("unknown option {what} for `#[{}]`", kind.name());
    let bare = what.trim_matches('`');
    if bare == kind.other().out_option() {
        message.push_str(&format!(
            "; did you mean `{}`? (`{}` belongs to `#[{}]`)",
            kind.out_option(),
            bare,
            kind.other().name()
        ));
    } else if let Some(close) = suggest::closest(bare, &options) {
        message.push_str(&format!("; did you mean `{close}`?"));
    } else {
        message.push_str(&format!("; the options are {}", suggest::list(&options)));
    }
    message
}

/// `out_fp32`, `out_fp32 = true` or `out_fp32 = false`.
fn parse_flag(cx: &mut Ctxt, name: &str, meta: &Meta) -> bool {
    match meta {
        Meta::Path(_) => true,
        Meta::NameValue(nv) => match &nv.value {
            Expr::Lit(ExprLit {
                lit: Lit::Bool(value),
                ..
            }) => value.value,
            other => {
                cx.error_spanned_by(
                    other,
                    format!("`{name}` is a switch: write `{name}` or `{name} = true`"),
                );
                false
            }
        },
        Meta::List(list) => {
            cx.error_spanned_by(
                list,
                format!("`{name}` is a switch: write `{name}` or `{name} = true`"),
            );
            false
        }
    }
}

/// `apply_to = (x, y)`, `apply_to = x`, `apply_to = [x, y]`, `apply_to = ("x", "y")` (MMCV's
/// spelling) or `apply_to(x, y)`.
fn parse_names(cx: &mut Ctxt, name: &str, meta: &Meta) -> Option<Vec<Ident>> {
    let usage = format!("`{name}` takes argument names: `{name} = (x, y)`");
    let items: Vec<Expr> = match meta {
        Meta::Path(path) => {
            cx.error_spanned_by(path, usage);
            return None;
        }
        Meta::List(list) => {
            match Punctuated::<Expr, Token![,]>::parse_terminated.parse2(list.tokens.clone()) {
                Ok(items) => items.into_iter().collect(),
                Err(_) => {
                    cx.error_spanned_by(list, usage);
                    return None;
                }
            }
        }
        Meta::NameValue(nv) => match &nv.value {
            Expr::Tuple(tuple) => tuple.elems.iter().cloned().collect(),
            Expr::Array(array) => array.elems.iter().cloned().collect(),
            Expr::Paren(paren) => vec![(*paren.expr).clone()],
            single => vec![single.clone()],
        },
    };

    let mut names: Vec<Ident> = Vec::new();
    for item in items {
        let ident = match &item {
            Expr::Path(path) if path.path.get_ident().is_some() => path.path.get_ident().cloned(),
            Expr::Lit(ExprLit {
                lit: Lit::Str(text),
                ..
            }) => syn::parse_str::<Ident>(&text.value())
                .ok()
                .map(|ident| Ident::new(&ident.to_string(), text.span())),
            _ => None,
        };
        match ident {
            Some(ident) if names.contains(&ident) => {
                cx.error_spanned_by(&item, format!("`{ident}` is named twice in `{name}`"));
            }
            Some(ident) => names.push(ident),
            None => cx.error_spanned_by(&item, usage.clone()),
        }
    }
    Some(names)
}
