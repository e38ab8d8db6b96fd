//! One place that collects every error of a macro invocation, so that several mistakes are
//! reported in one compile (serde_derive's `Ctxt`).

use proc_macro2::TokenStream;
use quote::{quote, ToTokens};
use std::fmt::Display;

#[derive(Default)]
pub struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    /// Records an error spanned on `tokens`.
    pub fn error_spanned_by<T: ToTokens, M: Display>(&mut self, tokens: T, message: M) {
        self.errors
            .push(syn::Error::new_spanned(tokens.into_token_stream(), message));
    }

    /// Records an error built elsewhere (a parse error, say).
    pub fn syn_error(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// The `compile_error!`s of every recorded error, or `None` when there was none.
    pub fn check(self) -> Option<TokenStream> {
        if self.errors.is_empty() {
            return None;
        }
        let errors = self.errors.iter().map(syn::Error::to_compile_error);
        Some(quote!(#(#errors)*))
    }
}
