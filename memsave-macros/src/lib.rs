//! Attribute macros of memsave. Each macro is parse -> validate -> expand in its own module;
//! every mistake is reported with its span, several in one compile, and on error the item is
//! emitted unchanged beside the errors so that the rest of the crate still type-checks.

#![warn(missing_docs)]

use proc_macro::TokenStream;

mod args;
mod crate_path;
mod ctxt;
mod fp16;
mod model;
mod suggest;
mod with_cp;

#[cfg(test)]
mod snapshots;

/// Casts the method's fp32 tensor arguments to half when the module's `fp16_enabled` flag is
/// on (MMCV's `auto_fp16`).
///
/// `#[auto_fp16]` casts every argument taken by value; `#[auto_fp16(apply_to = (x, y))]` (or
/// `args = ...`) only the named ones, which may also be borrowed (`&Tensor`: a cast copy is
/// borrowed). `out_fp32` casts the output back to fp32. Flag off: the method runs unchanged.
#[proc_macro_attribute]
pub fn auto_fp16(args: TokenStream, item: TokenStream) -> TokenStream {
    fp16::cast_attribute(fp16::Kind::AutoFp16, args.into(), item.into()).into()
}

/// Casts the method's half tensor arguments to fp32 when the module's `fp16_enabled` flag is
/// on, so that the body runs in fp32 (MMCV's `force_fp32`).
///
/// Options as [`macro@auto_fp16`]: `args = (x, y)` (or `apply_to`), and `out_fp16` to cast the
/// output back to half.
#[proc_macro_attribute]
pub fn force_fp32(args: TokenStream, item: TokenStream) -> TokenStream {
    fp16::cast_attribute(fp16::Kind::ForceFp32, args.into(), item.into()).into()
}

/// Recomputes the method's body in backward instead of keeping its activations, when the
/// module's `with_cp` flag is on and the input requires grad (MMCV's `with_cp`); otherwise the
/// method runs as written.
///
/// On a field of a `#[memsave::model]` struct, marks the block(s) that `set_with_cp` switches
/// checkpointing on in. Not on the layer that receives the network's input straight (in an
/// `#[auto_fp16]` method, `self.stem.forward(images)`): that input does not require grad, and
/// using such a field that way is a compile error naming the argument and the method.
#[proc_macro_attribute]
pub fn with_cp(args: TokenStream, item: TokenStream) -> TokenStream {
    with_cp::with_cp_attribute(args.into(), item.into()).into()
}

/// Makes a struct, or an enum of modules, a memsave model. It implements:
/// - `Fp16Module`, so that `wrap_fp16_model` reaches every field (and switches the flag on);
/// - `HasFp16Flag`, when the struct has a field `fp16_enabled: Fp16` (for `#[auto_fp16]` and
///   `#[force_fp32]`);
/// - `CheckpointModule`, when the struct has a field `with_cp: bool` or fields marked
///   `#[with_cp]` (for `set_with_cp`);
/// - `HasWithCp`, when the struct has the `with_cp` flag (for `#[with_cp]` methods).
///
/// It also implements `RandomDraws` (whether a field draws from the backend's random stream,
/// so that a `#[with_cp]` segment replays Burn's dropout), and, with the `with_cp` flag, rejects
/// Burn's `Dropout` and `GaussianNoise` fields (the recomputation would draw anew; memsave's
/// replay their draws).
///
/// Put it above `#[derive(Module)]`. Field attributes: `#[with_cp]` marks a field (a block, or a
/// `Vec` of them) that `set_with_cp` switches in turn; `#[fp16(fp32)]` keeps a layer in fp32 as
/// an island (its type becomes `memsave::fp16::Fp32<T>`, built with `.into()`: inputs cast to
/// fp32, outputs cast back); `#[fp16(skip)]` leaves a field exactly as it is under
/// `wrap_fp16_model` (so does Burn's `#[module(skip)]`). On an enum, the variants' fields take
/// the same attributes (`Bottleneck(#[with_cp] Bottleneck<B>)`). A struct without an fp16 flag
/// takes any field type; `wrap_fp16_model` on a model holding it asks its fields to take part.
#[proc_macro_attribute]
pub fn model(args: TokenStream, item: TokenStream) -> TokenStream {
    model::model_attribute(args.into(), item.into()).into()
}
