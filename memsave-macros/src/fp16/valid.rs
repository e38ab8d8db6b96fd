//! Checks of a cast attribute against the method it is on.

use syn::{Ident, ImplItemFn, Pat, Type};

use super::attr::{CastAttr, Kind};
use crate::ctxt::Ctxt;
use crate::suggest;

/// How one argument is cast.
pub enum ArgCast {
    /// `x: T`: rebound as `let x = cast(x);`.
    Value { ident: Ident, mutable: bool },
    /// `x: &T`: rebound as `let x = &cast(x.clone());` (only when named).
    Borrowed { ident: Ident },
    /// A destructuring pattern, at this position among the typed arguments: the argument is
    /// renamed and the pattern bound after the cast.
    Pattern { index: usize },
}

/// What the expansion does.
pub struct Plan {
    pub casts: Vec<ArgCast>,
    pub out: bool,
}

/// Validates `attr` on `method`, recording every mistake in `cx`; the plan is meaningful only
/// when `cx` holds no error.
pub fn validate(cx: &mut Ctxt, kind: Kind, attr: &CastAttr, method: &ImplItemFn) -> Plan {
    let sig = &method.sig;
    let name = &sig.ident;

    if sig.receiver().is_none() {
        cx.error_spanned_by(
            name,
            format!(
                "`#[{}]` goes on a method of a module: it reads the module's `fp16_enabled` \
                 flag, but `{name}` has no `self` receiver; add `&self`, or cast by hand with \
                 `memsave::cast::cast_tensor_type`",
                kind.name()
            ),
        );
    }
    if let Some(token) = &sig.asyncness {
        cx.error_spanned_by(
            token,
            format!("`#[{}]` cannot be used on an `async fn`", kind.name()),
        );
    }
    if let Some(token) = &sig.constness {
        cx.error_spanned_by(
            token,
            format!(
                "`#[{}]` cannot be used on a `const fn`: casting runs tensor operations",
                kind.name()
            ),
        );
    }
    if let Some(other) = find_attr(method, kind.other().name()) {
        cx.error_spanned_by(
            other,
            format!(
                "a method takes `#[auto_fp16]` or `#[force_fp32]`, not both: they cast in \
                 opposite directions; keep `#[{}]` and drop this one, or split the method",
                kind.name()
            ),
        );
    }

    let typed = crate::args::typed(sig);
    let arg_names: Vec<String> = typed
        .iter()
        .filter_map(|arg| ident_of(&arg.pat).map(|(ident, _)| ident.to_string()))
        .collect();

    let mut casts = Vec::new();
    match &attr.args {
        // Every argument taken by value.
        None => {
            for (index, arg) in typed.iter().enumerate() {
                if matches!(*arg.ty, Type::Reference(_)) || matches!(*arg.pat, Pat::Wild(_)) {
                    continue;
                }
                casts.push(match ident_of(&arg.pat) {
                    Some((ident, mutable)) => ArgCast::Value { ident, mutable },
                    None => ArgCast::Pattern { index },
                });
            }
        }
        Some(names) => {
            for wanted in names {
                let found = typed.iter().find_map(|arg| {
                    ident_of(&arg.pat)
                        .filter(|(ident, _)| ident == wanted)
                        .map(|(ident, mutable)| (ident, mutable, &*arg.ty))
                });
                match found {
                    None => {
                        let real = if arg_names.is_empty() {
                            format!("`{name}` has no arguments besides `self`")
                        } else {
                            format!("its arguments are {}", suggest::list(&arg_names))
                        };
                        cx.error_spanned_by(
                            wanted,
                            format!("`{wanted}` is not an argument of `{name}`; {real}"),
                        );
                    }
                    Some((_, _, Type::Reference(reference))) if reference.mutability.is_some() => {
                        cx.error_spanned_by(
                            wanted,
                            format!(
                                "`{wanted}` is borrowed mutably, so it cannot be replaced by a \
                                 cast copy; take it by value or by `&`"
                            ),
                        );
                    }
                    Some((ident, _, Type::Reference(_))) => {
                        casts.push(ArgCast::Borrowed { ident });
                    }
                    Some((ident, mutable, _)) => casts.push(ArgCast::Value { ident, mutable }),
                }
            }
        }
    }
    Plan {
        casts,
        out: attr.out,
    }
}

/// The identifier bound by a plain `x` or `mut x` pattern.
fn ident_of(pat: &Pat) -> Option<(Ident, bool)> {
    match pat {
        Pat::Ident(pat_ident) if pat_ident.subpat.is_none() && pat_ident.by_ref.is_none() => {
            Some((pat_ident.ident.clone(), pat_ident.mutability.is_some()))
        }
        _ => None,
    }
}

/// The attribute `#[name]` or `#[path::name]` on the method, if any.
pub fn find_attr<'a>(method: &'a ImplItemFn, name: &str) -> Option<&'a syn::Attribute> {
    method.attrs.iter().find(|attr| is_attr(attr, name))
}

/// Whether `attr` is `#[name]`, `#[name(...)]` or `#[path::name(...)]`.
pub fn is_attr(attr: &syn::Attribute, name: &str) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == name)
}
