//! Checks of `#[with_cp]` against the method it is on.

use syn::{Ident, ImplItemFn, Pat, ReturnType, Type};

use crate::ctxt::Ctxt;

/// At most this many arguments: the segment's input is the tuple of them.
pub const MAX_ARGS: usize = 6;

pub struct Plan {
    /// One name per argument; `None` where the argument is a pattern to be renamed.
    pub args: Vec<Option<Ident>>,
}

pub fn validate(cx: &mut Ctxt, method: &ImplItemFn) -> Plan {
    let sig = &method.sig;
    let name = &sig.ident;
    match sig.receiver() {
        None => cx.error_spanned_by(
            name,
            format!(
                "`#[with_cp]` goes on a method of a module: it reads the module's `with_cp` flag \
                 and recomputes the module's layers, but `{name}` has no `self` receiver; add \
                 `&self`"
            ),
        ),
        Some(receiver) if receiver.mutability.is_some() => cx.error_spanned_by(
            receiver,
            "a checkpointed method runs twice (forward, and again in backward), so it must not \
             change the module: take `&self`",
        ),
        Some(receiver) if receiver.reference.is_none() => cx.error_spanned_by(
            receiver,
            "a checkpointed method keeps the module to recompute it in backward: take `&self`, \
             not `self`",
        ),
        Some(_) => {}
    }
    if let Some(token) = &sig.asyncness {
        cx.error_spanned_by(token, "`#[with_cp]` cannot be used on an `async fn`");
    }
    if let Some(token) = &sig.constness {
        cx.error_spanned_by(token, "`#[with_cp]` cannot be used on a `const fn`");
    }
    if let ReturnType::Default = sig.output {
        cx.error_spanned_by(
            name,
            format!(
                "`#[with_cp]` needs an output: `{name}` returns nothing, so there is nothing to \
                 recompute; return the segment's output tensor(s)"
            ),
        );
    }

    let args = crate::args::typed(sig);
    if args.is_empty() {
        cx.error_spanned_by(
            name,
            format!(
                "`#[with_cp]` needs a tensor argument: a checkpointed segment keeps only its \
                 input and recomputes from it, but `{name}` takes none besides `self`"
            ),
        );
    }
    if args.len() > MAX_ARGS {
        cx.error_spanned_by(
            args[MAX_ARGS],
            format!(
                "`#[with_cp]` takes at most {MAX_ARGS} arguments; pass more tensors in a `Vec` \
                 or a tuple"
            ),
        );
    }
    for arg in &args {
        if let Type::Reference(reference) = &*arg.ty {
            cx.error_spanned_by(
                reference,
                "a checkpointed segment keeps its input until backward, so it takes its tensors \
                 by value (they are reference-counted: `x.clone()` at the call costs nothing)",
            );
        }
    }
    Plan {
        args: args
            .iter()
            .map(|arg| match &*arg.pat {
                Pat::Ident(ident) if ident.subpat.is_none() && ident.by_ref.is_none() => {
                    Some(ident.ident.clone())
                }
                _ => None,
            })
            .collect(),
    }
}
