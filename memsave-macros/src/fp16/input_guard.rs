//! The first-layer guard of `#[auto_fp16]`, which follows the data: a method marked
//! `#[auto_fp16]` is where a network takes its input (MMCV puts `auto_fp16` on the forward that
//! receives the images), and that input does not require grad. A layer that receives it
//! straight (`self.stem.forward(images)`) and is marked `#[with_cp]` in its struct would never
//! be checkpointed (MMCV's run-time guard runs it as written): the expansion asks the struct,
//! through a hidden method per `#[with_cp]` field, and fails to compile if so, naming the
//! argument and the method.

use std::collections::HashSet;

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote_spanned};
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Expr, ImplItemFn, Member, Pat};

/// `self.FIELD.method(.., ARG, ..)` (or `self.FIELD[i].method(..)`) with `ARG` (or
/// `ARG.clone()`) an argument of the method not yet rebound.
struct Hit {
    field: String,
    argument: String,
    span: Span,
}

struct Finder {
    /// The method's arguments that still hold the input.
    live: HashSet<String>,
    hits: Vec<Hit>,
}

impl Finder {
    fn forget_pattern(&mut self, pat: &Pat) {
        struct Bound<'a>(&'a mut HashSet<String>);
        impl<'ast> Visit<'ast> for Bound<'_> {
            fn visit_pat_ident(&mut self, pat: &'ast syn::PatIdent) {
                self.0.remove(&pat.ident.to_string());
                visit::visit_pat_ident(self, pat);
            }
        }
        Bound(&mut self.live).visit_pat(pat);
    }

    /// The argument an expression passes on as it is: `x` or `x.clone()`.
    fn argument(&self, expr: &Expr) -> Option<String> {
        match expr {
            Expr::Path(path) => path
                .path
                .get_ident()
                .map(ToString::to_string)
                .filter(|name| self.live.contains(name)),
            Expr::MethodCall(call) if call.method == "clone" && call.args.is_empty() => {
                self.argument(&call.receiver)
            }
            Expr::Paren(paren) => self.argument(&paren.expr),
            _ => None,
        }
    }
}

/// `self.FIELD` or `self.FIELD[..]`: the field's name.
fn field_of_self(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Field(field) => match (&*field.base, &field.member) {
            (Expr::Path(base), Member::Named(name)) if base.path.is_ident("self") => {
                Some(name.to_string())
            }
            _ => None,
        },
        Expr::Index(index) => field_of_self(&index.expr),
        Expr::Paren(paren) => field_of_self(&paren.expr),
        _ => None,
    }
}

impl<'ast> Visit<'ast> for Finder {
    fn visit_local(&mut self, local: &'ast syn::Local) {
        // The initialiser still sees the argument; the pattern rebinds after it.
        if let Some(init) = &local.init {
            self.visit_local_init(init);
        }
        self.forget_pattern(&local.pat);
    }

    fn visit_expr_assign(&mut self, assign: &'ast syn::ExprAssign) {
        self.visit_expr(&assign.right);
        if let Expr::Path(path) = &*assign.left {
            if let Some(ident) = path.path.get_ident() {
                self.live.remove(&ident.to_string());
            }
        }
    }

    fn visit_expr_closure(&mut self, closure: &'ast syn::ExprClosure) {
        for input in &closure.inputs {
            self.forget_pattern(input);
        }
        visit::visit_expr_closure(self, closure);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        if let Some(field) = field_of_self(&call.receiver) {
            if let Some(argument) = call.args.iter().find_map(|arg| self.argument(arg)) {
                self.hits.push(Hit {
                    field,
                    argument,
                    span: call.span(),
                });
            }
        }
        visit::visit_expr_method_call(self, call);
    }

    // Nested items have their own `self` and arguments.
    fn visit_item(&mut self, _item: &'ast syn::Item) {}
}

/// The checks to put at the start of the `#[auto_fp16]` method's body: one per layer that
/// receives an argument straight, a type error (before monomorphisation, so `cargo check` sees
/// it) when that layer is marked `#[with_cp]`: the struct gives such a field a method
/// `__memsave_mark_FIELD` returning `Marked`, which wins over the local fallback returning
/// `Unmarked`; the field's type answers too (`Unmarked` for a container whose first layer
/// runs plainly, such as a backbone with its stem); only `Unmarked` from either satisfies the
/// local trait whose message names the argument and the method.
pub fn checks(memsave: &TokenStream, method: &ImplItemFn) -> Vec<TokenStream> {
    let live = crate::args::typed(&method.sig)
        .iter()
        .filter_map(|arg| match &*arg.pat {
            Pat::Ident(pat) => Some(pat.ident.to_string()),
            _ => None,
        })
        .collect();
    let mut finder = Finder {
        live,
        hits: Vec::new(),
    };
    finder.visit_block(&method.block);
    let name = method.sig.ident.to_string();
    let mut seen = HashSet::new();
    finder
        .hits
        .into_iter()
        .filter(|hit| seen.insert(hit.field.clone()))
        .map(|Hit { field, argument, span }| {
            let message = format!(
                "`#[with_cp]` cannot go on `{field}`: `{name}` passes its argument `{argument}` \
                 straight to `self.{field}`, and `{name}` (marked `#[auto_fp16]`) is where the \
                 network takes its input, which does not require grad"
            );
            let label = format!("`self.{field}` is marked `#[with_cp]` in its struct");
            let note = "that segment would never be checkpointed (MMCV's guard runs it as \
                        written; PyTorch only warns \"None of the inputs have \
                        requires_grad=True\"): checkpoint the layers after it";
            let mark = format_ident!("__memsave_mark_{}", field);
            let field_ident = format_ident!("{}", field);
            quote_spanned! {span=>
                #[allow(dead_code, non_camel_case_types)]
                {
                    #[diagnostic::on_unimplemented(message = #message, label = #label, note = #note)]
                    trait __MemsaveNotCheckpointed {}
                    impl __MemsaveNotCheckpointed for #memsave::fp16::__private::Unmarked {}
                    fn __memsave_require<T: __MemsaveNotCheckpointed>(_: T) {}
                    trait __MemsaveUnmarked {
                        fn #mark(&self) -> #memsave::fp16::__private::Unmarked {
                            #memsave::fp16::__private::Unmarked
                        }
                    }
                    impl<T: ?Sized> __MemsaveUnmarked for T {}
                    #[allow(unused_imports)]
                    use #memsave::fp16::__private::{MarkViaFallback as _, MarkViaTrait as _};
                    let __memsave_mark = #memsave::fp16::__private::both(
                        self.#mark(),
                        (&#memsave::fp16::__private::MarkProbe(&self.#field_ident)).cp_mark(),
                    );
                    __memsave_require(__memsave_mark);
                }
            }
        })
        .collect()
}
