//! Checks of a `#[memsave::model]` struct.

use syn::Type;

use super::ast::{Model, FP16_FLAG};
use crate::ctxt::Ctxt;

pub fn validate(cx: &mut Ctxt, model: &Model) {
    if let Some(flag) = model.flag() {
        if !is_fp16_type(&flag.ty) {
            let flag_ty = &flag.ty;
            let found = quote::quote!(#flag_ty).to_string();
            cx.error_spanned_by(
                &flag.ty,
                format!(
                    "`{FP16_FLAG}` must have type `memsave::fp16::Fp16`, not `{}`: the flag also \
                     carries the half type chosen by `wrap_fp16_model` (f16 or bf16); write \
                     `{FP16_FLAG}: Fp16` and start it at `Fp16::Off`",
                    type_name(&flag.ty).unwrap_or(found)
                ),
            );
        }
        if flag.fp16_skip {
            cx.error_spanned_by(
                &flag.ident,
                format!("`{FP16_FLAG}` is the fp16 flag itself; it cannot be skipped"),
            );
        }
    }
}

/// `Fp16`, `fp16::Fp16` or `memsave::fp16::Fp16`.
fn is_fp16_type(ty: &Type) -> bool {
    matches!(ty, Type::Path(path)
        if path.qself.is_none()
            && path.path.segments.last().is_some_and(|s| s.ident == "Fp16" && s.arguments.is_empty()))
}

fn type_name(ty: &Type) -> Option<String> {
    match ty {
        Type::Path(path) => path.path.get_ident().map(ToString::to_string),
        _ => None,
    }
}
