//! Expansion snapshots, one per macro form: any change to generated code shows up in review.
//! Update with `cargo insta review` (or `INSTA_UPDATE=always cargo test -p memsave-macros`).

use proc_macro2::TokenStream;
use quote::quote;

use crate::fp16::{cast_attribute, Kind};
use crate::model::model_attribute;

fn pretty(tokens: TokenStream) -> String {
    let file = syn::parse2::<syn::File>(tokens).expect("the expansion is valid Rust");
    prettyplease::unparse(&file)
}

/// A method expansion, shown inside its `impl` block.
fn method(kind: Kind, args: TokenStream, item: TokenStream) -> String {
    let expanded = cast_attribute(kind, args, item);
    pretty(quote!(impl<B: Backend> Head<B> { #expanded }))
}

#[test]
fn auto_fp16_every_argument() {
    insta::assert_snapshot!(method(
        Kind::AutoFp16,
        quote!(),
        quote! {
            /// `[N, C, H, W]` -> `[N, C, H, W]`.
            pub fn forward(&self, x: Tensor<B, 4>, mut scales: Vec<Tensor<B, 1>>, stride: usize) -> Tensor<B, 4> {
                scales.push(x.clone().mean());
                self.conv.forward(x)
            }
        }
    ));
}

#[test]
fn auto_fp16_apply_to_out_fp32() {
    insta::assert_snapshot!(method(
        Kind::AutoFp16,
        quote!(apply_to = (x, anchors), out_fp32),
        quote! {
            fn forward(&self, x: Tensor<B, 4>, anchors: &Tensor<B, 2>, (a, b): (Tensor<B, 1>, Tensor<B, 1>)) -> Tensor<B, 4> {
                if a.dims()[0] == 0 {
                    return x;
                }
                self.head.forward(x, anchors, b)
            }
        }
    ));
}

#[test]
fn force_fp32_args_out_fp16() {
    insta::assert_snapshot!(method(
        Kind::ForceFp32,
        quote!(args = (cls_scores, bbox_preds), out_fp16),
        quote! {
            fn loss(&self, cls_scores: Vec<Tensor<B, 4>>, bbox_preds: Vec<Tensor<B, 4>>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
                focal_loss(cls_scores, labels) + l1_loss(bbox_preds)
            }
        }
    ));
}

#[test]
fn force_fp32_every_argument_by_value_self() {
    insta::assert_snapshot!(method(
        Kind::ForceFp32,
        quote!(),
        quote! {
            fn into_loss(self, (scores, targets): (Tensor<B, 2>, Tensor<B, 2>)) -> Tensor<B, 1> {
                (scores - targets).abs().sum()
            }
        }
    ));
}

#[test]
fn model_with_flag_and_skipped_field() {
    insta::assert_snapshot!(pretty(model_attribute(
        quote!(),
        quote! {
            #[derive(Module, Debug)]
            pub struct ConvBn<B: Backend> {
                conv: Conv2d<B>,
                bn: BatchNorm<B>,
                #[fp16(skip)]
                stats: Linear<B>,
                blocks: Vec<Block<B>>,
                fp16_enabled: Fp16,
            }
        }
    )));
}

#[test]
fn model_without_flag() {
    insta::assert_snapshot!(pretty(model_attribute(
        quote!(),
        quote! {
            #[derive(Module, Debug)]
            pub struct Backbone<B: Backend, const N: usize> where B::FloatElem: Copy {
                stem: Stem<B>,
                #[module(skip)]
                depth: usize,
                stages: [Stage<B>; N],
            }
        }
    )));
}

fn with_cp_method(item: TokenStream) -> String {
    let expanded = crate::with_cp::with_cp_attribute(quote!(), item);
    pretty(quote!(impl<B: memsave::Backend> Bottleneck<B> { #expanded }))
}

#[test]
fn with_cp_one_input() {
    insta::assert_snapshot!(with_cp_method(quote! {
        /// The residual branch and the skip, without the final ReLU.
        #[auto_fp16]
        pub fn residual(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
            let identity = match &self.downsample {
                Some(downsample) => downsample.forward(x.clone()),
                None => x.clone(),
            };
            self.bn3.forward(self.conv3.forward(x)) + identity
        }
    }));
}

#[test]
fn with_cp_several_inputs_and_outputs() {
    insta::assert_snapshot!(with_cp_method(quote! {
        fn forward(&self, mut c3: Tensor<B, 4>, (c4, c5): (Tensor<B, 4>, Tensor<B, 4>)) -> (Tensor<B, 4>, Tensor<B, 4>) {
            c3 = self.lateral3.forward(c3);
            (c3 + self.up.forward(c4), c5)
        }
    }));
}

/// On Burn 0.22: a module without a backend parameter, the runtime `memsave-next`.
#[test]
fn with_cp_on_burn_0_22() {
    let expanded = crate::with_cp::with_cp_for(
        (quote!(::memsave_next), crate::crate_path::Burn::V0_22),
        quote!(),
        quote! {
            fn forward(&self, x: Tensor<3>, mask_pad: Option<Tensor<2, Bool>>) -> Tensor<3> {
                self.layer.forward(x, mask_pad, None)
            }
        },
    );
    insta::assert_snapshot!(pretty(quote!(impl Block { #expanded })));
}

/// On Burn 0.22: a model without the fp16 flag (its `Fp16Module` bound on its fields), the
/// checkpointing impls with the marks in `checkpoint`.
#[test]
fn model_on_burn_0_22() {
    insta::assert_snapshot!(pretty(crate::model::model_for(
        (quote!(::memsave_next), crate::crate_path::Burn::V0_22),
        quote!(),
        quote! {
            #[derive(Module, Debug)]
            pub struct Encoder {
                embed: Linear,
                #[with_cp]
                blocks: Vec<Block>,
                with_cp: bool,
            }
        }
    )));
}

/// On Burn 0.22, a model in which nothing can be switched: the bound that names its fields, on
/// the runtime's own types.
#[test]
fn model_on_burn_0_22_without_a_switch() {
    insta::assert_snapshot!(pretty(crate::model::model_for(
        (quote!(::memsave_next), crate::crate_path::Burn::V0_22),
        quote!(),
        quote! {
            #[derive(Module, Debug)]
            pub struct Head {
                fc: Linear,
            }
        }
    )));
}

/// On Burn 0.22: `#[auto_fp16]` on a module without a backend parameter, the runtime
/// `memsave-next`, the first-layer guard asking the marks.
#[test]
fn auto_fp16_on_burn_0_22() {
    let expanded = crate::fp16::cast_attribute_for(
        &quote!(::memsave_next),
        Kind::AutoFp16,
        quote!(apply_to = (x), out_fp32 = true),
        quote! {
            fn forward(&self, x: Tensor<3>, mask_pad: Option<Tensor<2, Bool>>) -> Tensor<3> {
                let x = self.embed.forward(x);
                self.blocks.forward(x, mask_pad)
            }
        },
    );
    insta::assert_snapshot!(pretty(quote!(impl Encoder { #expanded })));
}

/// A crate that depends on memsave for both Burns: the fp16 attributes and `#[with_cp]` say so,
/// keeping the method as written (the rest of the crate still type-checks).
#[test]
fn two_runtimes_are_an_error() {
    let method = quote! {
        fn forward(&self, x: Tensor<4>) -> Tensor<4> {
            x
        }
    };
    for kind in [Kind::AutoFp16, Kind::ForceFp32] {
        let output = crate::fp16::cast_attribute_in(
            Err("two runtimes".to_string()),
            kind,
            quote!(),
            method.clone(),
        )
        .to_string();
        assert!(output.starts_with("fn forward"), "{output}");
        assert!(
            output.contains("compile_error") && output.contains("two runtimes"),
            "{output}"
        );
    }
    let output =
        crate::with_cp::with_cp_in(Err("two runtimes".to_string()), quote!(), method).to_string();
    assert!(
        output.contains("compile_error") && output.contains("two runtimes"),
        "{output}"
    );
}

/// On Burn 0.22, a mixed-precision model: the flag, an fp32 island (`memsave_next`'s `Fp32`),
/// a skipped field, a checkpointed one; no random-draw probe or segment guard (the runtime
/// replays Burn's draws).
#[test]
fn model_on_burn_0_22_with_fp16() {
    insta::assert_snapshot!(pretty(crate::model::model_for(
        (quote!(::memsave_next), crate::crate_path::Burn::V0_22),
        quote!(),
        quote! {
            #[derive(Module, Debug)]
            pub struct Net {
                embed: Linear,
                #[with_cp]
                blocks: Vec<Block>,
                #[fp16(fp32)]
                norm: LayerNorm,
                #[fp16(skip)]
                scale: f32,
                fp16_enabled: Fp16,
                with_cp: bool,
            }
        }
    )));
}

#[test]
fn model_with_checkpointed_fields() {
    insta::assert_snapshot!(pretty(model_attribute(
        quote!(),
        quote! {
            #[derive(Module, Debug)]
            pub struct ResNet<B: Backend> {
                stem: Stem<B>,
                #[with_cp]
                layer1: Vec<Bottleneck<B>>,
                #[with_cp]
                layer2: Vec<Bottleneck<B>>,
                with_cp: bool,
            }
        }
    )));
}

#[test]
fn model_enum_of_blocks() {
    insta::assert_snapshot!(pretty(model_attribute(
        quote!(),
        quote! {
            #[derive(Module, Debug)]
            pub enum Block<B: Backend> {
                Basic(#[with_cp] BasicBlock<B>),
                Bottleneck(#[with_cp] Bottleneck<B>),
                Projected { #[with_cp] block: Bottleneck<B>, #[fp16(skip)] scale: Linear<B> },
                Identity,
            }
        }
    )));
}
