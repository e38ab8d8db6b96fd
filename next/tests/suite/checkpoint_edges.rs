//! The edges of checkpointing on Burn 0.22.1 (Flex), ported from memsave 0.21's
//! `tests/suite/checkpoint_edges.rs` and `tests/suite/checkpoint.rs`: segments nested in segments (a
//! backward inside a backward inside a backward), outputs shared by several consumers, many
//! inputs, a segment that panics while it is recomputed, and `#[with_cp]` where its generated
//! names could collide. Each against the plain run, bit for bit, under both of Burn's strategies.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use memsave_macros::{model, with_cp};
use memsave_next::checkpoint::{checkpoint, checkpoint_with, set_with_cp, Options};

use crate::common;
use common::{assert_close, assert_same_bits, bits, devices, grad_bits, initialized, watchdog};

fn fixed<const D: usize>(device: &Device, shape: [usize; D], seed: u64) -> Tensor<D> {
    let count = shape.iter().product::<usize>();
    let values: Vec<f32> = (0..count)
        .map(|i| ((i as u64 * 2_654_435_761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Every level's module is the whole `Vec` of layers; level `k` runs layer `k` and hands the
/// rest to level `k + 1`, checkpointed in turn: segments nested in each other, as deep as there
/// are layers.
#[derive(Module, Debug)]
struct Suffix {
    layers: Vec<Linear>,
}

fn suffix_forward(layers: &Suffix, x: Tensor<2>, from: usize, checkpointed: bool) -> Tensor<2> {
    if from == layers.layers.len() {
        return x;
    }
    let run = move |module: &Suffix, x: Tensor<2>| {
        let y = module.layers[from].forward(x).tanh();
        suffix_forward(module, y, from + 1, checkpointed)
    };
    if checkpointed {
        checkpoint(layers, x, run)
    } else {
        run(layers, x)
    }
}

#[test]
fn four_nested_levels_match_plain() {
    watchdog(120, || {
        for (strategy, device) in devices() {
            device.seed(1);
            let model = initialized(Suffix {
                layers: (0..4)
                    .map(|_| LinearConfig::new(6, 6).init(&device))
                    .collect(),
            });
            let x = fixed(&device, [3, 6], 1).require_grad();
            let g_plain = suffix_forward(&model, x.clone(), 0, false).sum().backward();
            let g_cp = suffix_forward(&model, x.clone(), 0, true).sum().backward();
            assert_same_bits(
                &grad_bits(&model, &g_plain),
                &grad_bits(&model, &g_cp),
                strategy,
            );
            assert_eq!(
                x.grad(&g_plain).map(bits),
                x.grad(&g_cp).map(bits),
                "{strategy}"
            );
        }
    });
}

/// A block with a checkpointed method that calls two checkpointed inner blocks, one of them
/// holding a parameter it never uses.
#[model]
#[derive(Module, Debug)]
struct Inner {
    fc: Linear,
    unused: Linear,
    with_cp: bool,
}

impl Inner {
    #[with_cp]
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc.forward(x).tanh()
    }
}

#[model]
#[derive(Module, Debug)]
struct Outer {
    #[with_cp]
    first: Inner,
    #[with_cp]
    second: Inner,
    fc: Linear,
    with_cp: bool,
}

impl Outer {
    #[with_cp]
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.first.forward(x);
        self.fc.forward(self.second.forward(h))
    }
}

#[test]
fn nested_with_cp_blocks_match_plain_and_an_unused_inner_layer_gets_nothing() {
    watchdog(120, || {
        for (strategy, device) in devices() {
            device.seed(2);
            let inner = |device: &Device| Inner {
                fc: LinearConfig::new(8, 8).init(device),
                unused: LinearConfig::new(8, 8).init(device),
                with_cp: false,
            };
            let plain = initialized(Outer {
                first: inner(&device),
                second: inner(&device),
                fc: LinearConfig::new(8, 4).init(&device),
                with_cp: false,
            });
            let nested = set_with_cp(plain.clone(), true);
            assert!(nested.with_cp && nested.first.with_cp && nested.second.with_cp);
            let x = fixed(&device, [5, 8], 2).require_grad();
            let g_plain = plain.forward(x.clone()).powi_scalar(2).sum().backward();
            let g_cp = nested.forward(x.clone()).powi_scalar(2).sum().backward();
            let (plain_grads, nested_grads) =
                (grad_bits(&plain, &g_plain), grad_bits(&nested, &g_cp));
            assert_same_bits(&plain_grads, &nested_grads, strategy);
            assert!(
                nested.first.unused.weight.grad(&g_cp).is_none(),
                "{strategy}"
            );
            assert_eq!(
                x.grad(&g_plain).map(bits),
                x.grad(&g_cp).map(bits),
                "{strategy}"
            );
        }
    });
}

/// FPN-like: a segment with three outputs, one read by two later ops and inside the segment
/// too, one by a later segment, one ignored.
///
/// Not bit for bit: `p`'s gradient is the sum of three terms, two from outside the segment and
/// one from inside it. Plain Burn adds them in the order its backward reaches them; checkpointed,
/// the two outside terms are added by the outer graph before the recomputation starts and the
/// inside one by the inner graph after, so the rounding may differ in the last place (seen: 1
/// ulp on 6 of 36 values). The same holds for `torch.utils.checkpoint`.
#[derive(Module, Debug)]
struct Lateral {
    a: Linear,
    b: Linear,
    c: Linear,
}

#[test]
fn outputs_shared_by_several_consumers_and_one_ignored_match_plain() {
    watchdog(120, || {
        for (strategy, device) in devices() {
            device.seed(3);
            let model = initialized(Lateral {
                a: LinearConfig::new(6, 6).init(&device),
                b: LinearConfig::new(6, 6).init(&device),
                c: LinearConfig::new(6, 6).init(&device),
            });
            let x = fixed(&device, [4, 6], 3).require_grad();
            let step = |checkpointed: bool| {
                let lateral = |m: &Lateral, x: Tensor<2>| {
                    let p = m.a.forward(x.clone()).tanh();
                    let q = m.b.forward(p.clone());
                    let r = m.c.forward(x);
                    (p, q, r)
                };
                let (p, q, _r) = checkpoint_with(
                    Options::new().enabled(checkpointed),
                    &model,
                    x.clone(),
                    lateral,
                );
                // `q` into a later segment, `p` read twice.
                let later = checkpoint_with(
                    Options::new().enabled(checkpointed),
                    &model,
                    q,
                    |m: &Lateral, q| m.c.forward(q).exp(),
                );
                let loss = (p.clone() * 3.0).sum() + (p * later).sum();
                let grads = loss.backward();
                let mut all = grad_bits(&model, &grads);
                all.push(x.grad(&grads).map(bits));
                all
            };
            let worst = assert_close(&step(false), &step(true), 1e-6, strategy);
            eprintln!("{strategy}: largest relative difference {worst:e}");
        }
    });
}

#[test]
fn twenty_inputs_in_a_vec_match_plain() {
    watchdog(120, || {
        for (strategy, device) in devices() {
            device.seed(4);
            let model = initialized(LinearConfig::new(6, 6).init(&device));
            let maps: Vec<Tensor<2>> = (0..20)
                .map(|i| fixed(&device, [3, 6], i).require_grad())
                .collect();
            let step = |checkpointed: bool| {
                let y = checkpoint_with(
                    Options::new().enabled(checkpointed),
                    &model,
                    maps.clone(),
                    |fc: &Linear, maps: Vec<Tensor<2>>| {
                        let sum = maps
                            .into_iter()
                            .enumerate()
                            .map(|(i, m)| m * (i as f64 + 1.0))
                            .reduce(|a, b| a + b)
                            .expect("maps");
                        fc.forward(sum)
                    },
                );
                let grads = y.powi_scalar(2).sum().backward();
                let mut all = grad_bits(&model, &grads);
                all.extend(maps.iter().map(|m| m.grad(&grads).map(bits)));
                all
            };
            let plain = step(false);
            assert!(plain.iter().all(Option::is_some), "{strategy}");
            assert_same_bits(&plain, &step(true), strategy);
        }
    });
}

/// A segment that panics on its second run: in the recomputation.
#[derive(Module, Debug)]
struct Fragile {
    fc: Linear,
}

thread_local! {
    static FRAGILE_RUNS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[test]
fn a_panic_while_recomputing_reaches_backward_without_a_hang_and_the_next_step_works() {
    watchdog(60, || {
        let device = Device::flex().autodiff();
        let model = initialized(Fragile {
            fc: LinearConfig::new(4, 4).init(&device),
        });
        let x = fixed(&device, [2, 4], 5).require_grad();
        FRAGILE_RUNS.with(|runs| runs.set(0));
        let loss = checkpoint(&model, x.clone(), |m: &Fragile, x| {
            let run = FRAGILE_RUNS.with(|runs| {
                runs.set(runs.get() + 1);
                runs.get()
            });
            assert!(run < 2, "boom");
            m.fc.forward(x)
        })
        .sum();
        let outcome = common::catch_quietly(|| loss.backward());
        let Err(payload) = outcome else {
            panic!("the backward pass must fail")
        };
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert!(
            message.contains("the checkpointed segment `Fragile` panicked while it was recomputed")
                && message.contains("boom"),
            "{message}"
        );
        // The next step, checkpointed, is whole.
        let y = checkpoint(&model, x.clone(), |m: &Fragile, x| m.fc.forward(x));
        let grads = y.sum().backward();
        assert!(model.fc.weight.grad(&grads).is_some());
        assert!(x.grad(&grads).is_some());
    });
}

/// `#[with_cp]`'s generated names are hygienic: arguments named like them compile and work, and
/// a method of a trait impl is checkpointed too.
#[model]
#[derive(Module, Debug)]
struct Odd {
    fc: Linear,
    with_cp: bool,
}

trait Forward {
    fn run(&self, x: Tensor<2>, scale: f64) -> Tensor<2>;
}

impl Odd {
    #[with_cp]
    #[allow(non_snake_case)]
    fn forward(&self, __this: Tensor<2>, __segment: Tensor<2>, __arg0: f64) -> Tensor<2> {
        self.fc.forward(__this) * __arg0 + __segment
    }
}

impl Forward for Odd {
    #[with_cp]
    fn run(&self, x: Tensor<2>, scale: f64) -> Tensor<2> {
        self.fc.forward(x).mul_scalar(scale).tanh()
    }
}

#[test]
fn generated_names_do_not_collide_and_trait_methods_are_checkpointed() {
    watchdog(60, || {
        for (strategy, device) in devices() {
            device.seed(6);
            let plain = initialized(Odd {
                fc: LinearConfig::new(4, 4).init(&device),
                with_cp: false,
            });
            let checkpointed = set_with_cp(plain.clone(), true);
            let a = fixed(&device, [2, 4], 6).require_grad();
            let b = fixed(&device, [2, 4], 7).require_grad();
            let step = |model: &Odd| {
                let y = model.forward(a.clone(), b.clone(), 0.5);
                let z = Forward::run(model, y, 2.0);
                let grads = z.sum().backward();
                let mut all = grad_bits(model, &grads);
                all.push(a.grad(&grads).map(bits));
                all.push(b.grad(&grads).map(bits));
                all
            };
            assert_same_bits(&step(&plain), &step(&checkpointed), strategy);
        }
    });
}
