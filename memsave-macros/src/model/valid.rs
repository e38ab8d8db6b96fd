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
}

fn validate_fp16(cx: &mut Ctxt, model: &Model) {
    for field in model.all_fields() {
        let Some(attr) = &field.fp32 else { continue };
        if field
            .ident()
            .is_some_and(|ident| ident == FP16_FLAG || ident == CP_FLAG)
        {
            cx.error_spanned_by(
                attr,
                "`#[fp16(fp32)]` goes on a layer, not on a flag: it keeps the layer in fp32, its \
                 inputs cast to fp32 and its outputs cast back",
            );
        } else if field.module_skip {
            cx.error_spanned_by(
                attr,
                "`#[fp16(fp32)]` goes on a layer, and `#[module(skip)]` says this field is not \
                 one: drop one of the two",
            );
        } else if field.fp16_skip {
            cx.error_spanned_by(
                attr,
                "`#[fp16(fp32)]` and `#[fp16(skip)]` contradict each other: `fp32` casts the \
                 layer's inputs to fp32 and its outputs back, `skip` leaves everything as it is",
            );
        }
    }
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
