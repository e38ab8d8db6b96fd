//! What `#[memsave::model]` emits after an error: the item and impls that do nothing, so that
//! the user's other code (its `#[auto_fp16]` and `#[with_cp]` methods, its `wrap_fp16_model`
//! and `set_with_cp` calls) raises no second wave of errors; the errors themselves come beside.

use proc_macro2::TokenStream;
use quote::quote;

use super::ast::Model;
use crate::crate_path::Burn;

pub fn fallback(memsave: &TokenStream, burn: Burn, model: &Model) -> TokenStream {
    let item = &model.item;
    let (impl_generics, ty_generics, where_clause) = model.generics.split_for_impl();
    let name = &model.ident;
    let header = |trait_path: TokenStream| quote!(impl #impl_generics #trait_path for #name #ty_generics #where_clause);
    let unmarked = super::checkpoint::unmarked(memsave, burn);
    let fp16_module = header(quote!(#memsave::fp16::Fp16Module));
    let has_flag = model.flag().map(|_| {
        let header = header(quote!(#memsave::fp16::HasFp16Flag));
        quote! {
            #header {
                fn fp16_enabled(&self) -> #memsave::fp16::Fp16 {
                    #memsave::fp16::Fp16::Off
                }
            }
        }
    });
    let checkpoint_module = model.checkpointable().then(|| {
        let header = header(quote!(#memsave::checkpoint::CheckpointModule));
        quote! {
            #header {
                type Mark = #unmarked;

                fn set_with_cp(self, _on: bool) -> Self {
                    self
                }
            }
        }
    });
    let has_with_cp = model.cp_flag().map(|_| {
        let header = header(quote!(#memsave::checkpoint::HasWithCp));
        quote! {
            #header {
                fn with_cp(&self) -> bool {
                    false
                }
            }
        }
    });
    // Burn 0.22's runtime replays random draws by itself: no `RandomDraws` there.
    let random_draws = (burn == Burn::V0_21).then(|| {
        let header = header(quote!(#memsave::checkpoint::RandomDraws));
        quote! {
            #header {
                fn draws_random(&self) -> bool {
                    false
                }
            }
        }
    });
    quote! {
        #item
        #random_draws
        #fp16_module {
            fn wrap_fp16(self, _precision: #memsave::fp16::Precision) -> Self {
                self
            }
        }
        #has_flag
        #checkpoint_module
        #has_with_cp
    }
}
