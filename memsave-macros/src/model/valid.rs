//! Checks of a `#[memsave::model]` struct.

use syn::Type;

use super::ast::{Model, CP_FLAG, FP16_FLAG};
use crate::ctxt::Ctxt;

pub fn validate(cx: &mut Ctxt, model: &Model) {
    validate_fp16(cx, model);
    validate_with_cp(cx, model);
}

fn validate_with_cp(cx: &mut Ctxt, model: &Model) {
    if let Some(flag) = model.cp_flag() {
        if !matches!(&flag.ty, Type::Path(path) if path.path.is_ident("bool")) {
            cx.error_spanned_by(
                &flag.ty,
                format!("`{CP_FLAG}` is the checkpointing flag: give it type `bool`"),
            );
        }
        if let Some(attr) = &flag.with_cp {
            cx.error_spanned_by(
                attr,
                format!("`{CP_FLAG}` is the flag itself; mark the layers to checkpoint instead"),
            );
        }
    }
    if let Some(first) = model.first_layer() {
        if let Some(attr) = &first.with_cp {
            let name = first.ident().expect("a struct's fields have names");
            cx.error_spanned_by(
                attr,
                format!(
                    "`#[with_cp]` cannot go on `{name}`, the first layer: its input is the \
                     network's input (the image), which does not require grad, so the segment \
                     would run unrecorded and no gradient would reach the parameters of `{name}` \
                     (PyTorch only warns: \"None of the inputs have requires_grad=True\"); \
                     checkpoint the layers after it"
                ),
            );
        }
    }
}

fn validate_fp16(cx: &mut Ctxt, model: &Model) {
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
                &flag.member,
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
