//! Code generation for `#[with_cp]` on a method.

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream, TokenTree};
use quote::{format_ident, quote};
use syn::ImplItemFn;

use super::valid::Plan;
use crate::crate_path::Burn;

/// `fn forward(&self, x) -> y { body }` becomes
///
/// ```text
/// fn forward(&self, x) -> y {
///     let segment = |this: &Self, x| -> y { body, with `self` read as `this` };
///     checkpoint_with(
///         Options::new().method("forward").enabled(self.with_cp).random(self draws random numbers),
///         self, x, segment,
///     )
/// }
/// ```
///
/// `checkpoint_with` checkpoints when the flag is on (and the input requires grad) and runs the
/// segment as written otherwise; when the module draws from the backend's random stream, both
/// run under the segment's own stream, so that they give the same gradients.
///
/// The body becomes a closure that captures nothing (so that the recomputation can keep it),
/// not a second method: the expansion stays one method, so it works in a trait impl too. The
/// generated names (`__this`, `__segment`, `__argN`) are hygienic: no argument or local of the
/// user's can collide with them.
///
/// On Burn 0.22 (the runtime is `memsave-next`), whether the module draws is read by the runtime
/// from the module's layers, and the call is `checkpoint_with(Options::new().method(..)
/// .enabled(..), self, x, segment)`.
pub fn expand(memsave: &TokenStream, burn: Burn, plan: &Plan, method: ImplItemFn) -> TokenStream {
    let name = method.sig.ident.to_string();
    let this = Ident::new("__this", Span::mixed_site());
    let segment = Ident::new("__segment", Span::mixed_site());

    // The closure's parameter: the arguments' own patterns and types.
    let typed = crate::args::typed(&method.sig);
    let patterns: Vec<&syn::Pat> = typed.iter().map(|arg| &*arg.pat).collect();
    let types: Vec<&syn::Type> = typed.iter().map(|arg| &*arg.ty).collect();
    let (param_pattern, param_type) = match (patterns.as_slice(), types.as_slice()) {
        ([pattern], [ty]) => (quote!(#pattern), quote!(#ty)),
        (patterns, types) => (quote!((#(#patterns),*)), quote!((#(#types),*))),
    };
    let output = match &method.sig.output {
        syn::ReturnType::Default => quote!(),
        syn::ReturnType::Type(arrow, ty) => quote!(#arrow #ty),
    };
    let body = replace_self(method.block.to_token_stream_inner(), &this);

    // The method keeps its name, attributes and signature; arguments that are patterns get
    // names, and none is `mut` (it only passes them on).
    let mut dispatcher = method;
    let names: Vec<Ident> = plan
        .args
        .iter()
        .enumerate()
        .map(|(index, name)| {
            name.clone()
                .unwrap_or_else(|| format_ident!("__arg{}", index, span = Span::mixed_site()))
        })
        .collect();
    for (arg, name) in crate::args::typed_mut(&mut dispatcher.sig).zip(&names) {
        *arg.pat = syn::parse_quote!(#name);
    }
    let input = match names.as_slice() {
        [single] => quote!(#single),
        many => quote!((#(#many),*)),
    };
    dispatcher.block = match burn {
        Burn::V0_22 => syn::parse_quote!({
            let #segment = |#this: &Self, #param_pattern: #param_type| #output { #body };
            #memsave::checkpoint::checkpoint_with(
                #memsave::checkpoint::Options::new()
                    .method(#name)
                    .enabled(#memsave::checkpoint::HasWithCp::with_cp(self)),
                self,
                #input,
                #segment,
            )
        }),
        Burn::V0_21 => v0_21(
            memsave,
            &name,
            &this,
            &segment,
            &input,
            body,
            param_pattern,
            param_type,
            output,
        ),
    };
    quote!(#dispatcher)
}

/// The body on Burn 0.21: whether the module draws is found by the macro's probe.
#[allow(clippy::too_many_arguments)]
fn v0_21(
    memsave: &TokenStream,
    name: &str,
    this: &Ident,
    segment: &Ident,
    input: &TokenStream,
    body: TokenStream,
    param_pattern: TokenStream,
    param_type: TokenStream,
    output: TokenStream,
) -> syn::Block {
    syn::parse_quote!({
        let #segment = |#this: &Self, #param_pattern: #param_type| #output { #body };
        #[allow(unused_imports)]
        use #memsave::checkpoint::__private::{ViaFallback as _, ViaTrait as _};
        #memsave::checkpoint::checkpoint_with(
            #memsave::checkpoint::Options::new()
                .method(#name)
                .enabled(#memsave::checkpoint::HasWithCp::with_cp(self))
                .random((&#memsave::checkpoint::__private::Probe(self)).draws_random()),
            self,
            #input,
            #segment,
        )
    })
}

/// The statements of a block, without its braces.
trait BlockTokens {
    fn to_token_stream_inner(&self) -> TokenStream;
}

impl BlockTokens for syn::Block {
    fn to_token_stream_inner(&self) -> TokenStream {
        let statements = &self.stmts;
        quote!(#(#statements)*)
    }
}

/// `tokens` with every `self` that means the receiver replaced by `this`: not a path's first
/// segment (`self::module`), and not inside a nested `fn` or `impl`, whose `self` is its own.
fn replace_self(tokens: TokenStream, this: &Ident) -> TokenStream {
    let mut out = Vec::new();
    let mut trees = tokens.into_iter().peekable();
    // Set after `fn` or `impl`: the next brace group is a nested item's body.
    let mut nested_item = false;
    while let Some(tree) = trees.next() {
        match tree {
            TokenTree::Ident(ident) if ident == "self" => {
                let is_path =
                    matches!(trees.peek(), Some(TokenTree::Punct(p)) if p.as_char() == ':');
                if is_path || nested_item {
                    out.push(TokenTree::Ident(ident));
                } else {
                    let mut replaced = this.clone();
                    replaced.set_span(this.span().located_at(ident.span()));
                    out.push(TokenTree::Ident(replaced));
                }
            }
            TokenTree::Ident(ident) if ident == "fn" || ident == "impl" => {
                nested_item = true;
                out.push(TokenTree::Ident(ident));
            }
            TokenTree::Group(group) if nested_item && group.delimiter() == Delimiter::Brace => {
                nested_item = false;
                out.push(TokenTree::Group(group));
            }
            TokenTree::Group(group) if nested_item => out.push(TokenTree::Group(group)),
            TokenTree::Group(group) => {
                let mut replaced =
                    Group::new(group.delimiter(), replace_self(group.stream(), this));
                replaced.set_span(group.span());
                out.push(TokenTree::Group(replaced));
            }
            TokenTree::Punct(punct) if nested_item && punct.as_char() == ';' => {
                // `impl` in a type position (`-> impl Trait;`) or a bodiless item.
                nested_item = false;
                out.push(TokenTree::Punct(punct));
            }
            other => out.push(other),
        }
    }
    out.into_iter().collect()
}
