//! Checkpointing on the graphs that real models have, where an earlier memsave panicked, hung or
//! dropped a gradient: inputs and outputs the recomputation does not reach, nested segments with
//! unused parameters, tracked tensors that enter a segment other than as its input, and the
//! macro on methods named or placed unusually. The rule: the same gradients as without
//! checkpointing, never a hang. Every test runs under a watchdog.

use crate::common;

use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::Distribution;
use common::{assert_same_grads, param_grads, values, watchdog, Materialise, AB};
use memsave::checkpoint::{
    checkpoint, recomputations, set_with_cp, uncheckpointed_segments, CheckpointModule,
};
use memsave::with_cp;

fn conv<B: Backend>(device: &B::Device) -> Conv2d<B> {
    Conv2dConfig::new([4, 4], [3, 3])
        .with_padding(PaddingConfig2d::Same)
        .init(device)
}

fn randn(shape: [usize; 4]) -> Tensor<AB, 4> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

/// Relative difference of two optional gradients; both absent is 0, one absent fails.
fn compare(name: &str, with: Option<Tensor<Flex, 4>>, without: Option<Tensor<Flex, 4>>) -> f32 {
    match (with, without) {
        (Some(a), Some(b)) => common::max_relative_difference(&values(a), &values(b)),
        (None, None) => 0.0,
        (a, b) => panic!(
            "{name}: a gradient with checkpointing: {}, without: {}",
            a.is_some(),
            b.is_some()
        ),
    }
}

use burn::backend::Flex;

// ---------------------------------------------------------------------------------------------
// 1. What the recomputation does not reach.

/// Two outputs: the first from `x`, the second from `z` alone.
#[memsave::model]
#[derive(Module, Debug)]
pub struct TwoOutputs<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> TwoOutputs<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>, z: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        (self.conv.forward(x), z.mul_scalar(3.0).exp())
    }
}

#[test]
fn an_unused_output_computed_from_a_non_leaf_input_does_not_break_backward() {
    let worst = watchdog(60, || {
        let device = Default::default();
        let plain = TwoOutputs::<AB> {
            conv: conv(&device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = randn([2, 4, 5, 5]).require_grad();
        let z0 = randn([2, 4, 5, 5]).require_grad();
        let w = randn([2, 4, 5, 5]);
        let step = |model: &TwoOutputs<AB>| {
            let z = z0.clone() * 2.0; // a non-leaf input
            let (y, _unused) = model.forward(x.clone(), z);
            (y * w.clone()).sum().backward()
        };
        let g_plain = step(&plain);
        let before = recomputations();
        let g_cp = step(&checkpointed);
        assert_eq!(recomputations() - before, 1);
        memsave::checkpoint::join_helpers().unwrap();
        let dx = compare("x", x.grad(&g_cp), x.grad(&g_plain));
        assert!(dx <= 1e-6, "x: {dx}");
        let params = assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
        // Burn's graph cannot say "no gradient" to the node of `z0 * 2` once it is in the
        // backward pass: it gets zeros, its true value, which reach `z0`.
        assert!(z0.grad(&g_plain).is_none());
        let dz0 = values(z0.grad(&g_cp).expect("zeros"));
        assert!(dz0.iter().all(|v| *v == 0.0));
        dx.max(params)
    });
    eprintln!("unused output: max relative difference {worst:e}");
}

/// Ignores its second input.
#[memsave::model]
#[derive(Module, Debug)]
pub struct IgnoresInput<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> IgnoresInput<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>, _z: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(x)
    }
}

#[test]
fn a_segment_that_ignores_a_non_leaf_input_does_not_break_backward() {
    watchdog(60, || {
        let device = Default::default();
        let plain = IgnoresInput::<AB> {
            conv: conv(&device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = randn([1, 4, 4, 4]).require_grad();
        let z0 = randn([1, 4, 4, 4]).require_grad();
        let step = |model: &IgnoresInput<AB>| {
            let z = z0.clone().exp();
            model.forward(x.clone(), z).sum().backward()
        };
        let g_plain = step(&plain);
        let g_cp = step(&checkpointed);
        memsave::checkpoint::join_helpers().unwrap();
        assert!(compare("x", x.grad(&g_cp), x.grad(&g_plain)) <= 1e-6);
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
        assert!(values(z0.grad(&g_cp).expect("zeros"))
            .iter()
            .all(|v| *v == 0.0));
    });
}

#[test]
fn a_leaf_input_the_segment_ignores_gets_no_gradient_as_without_checkpointing() {
    watchdog(60, || {
        let device = Default::default();
        let model = IgnoresInput::<AB> {
            conv: conv(&device),
            with_cp: true,
        };
        let x = randn([1, 4, 4, 4]).require_grad();
        let z = randn([1, 4, 4, 4]).require_grad();
        let grads = model.forward(x.clone(), z.clone()).sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        assert!(x.grad(&grads).is_some());
        assert!(z.grad(&grads).is_none());
    });
}

/// A segment whose output the next segment ignores.
#[test]
fn an_output_that_a_later_segment_ignores_gives_nothing_and_hangs_nothing() {
    watchdog(60, || {
        let device = Default::default();
        let first = IgnoresInput::<AB> {
            conv: conv(&device),
            with_cp: true,
        };
        let second = first.clone();
        let x = randn([1, 4, 4, 4]).require_grad();
        let a = randn([1, 4, 4, 4]).require_grad();
        let y = first.forward(a.clone(), x.clone()); // depends on `a` only
        let out = second.forward(x.clone(), y); // ignores `y`
        let grads = out.sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        assert!(x.grad(&grads).is_some());
        assert!(a.grad(&grads).is_none(), "nothing reached `a`");
    });
}

/// An outer block whose segment calls an inner checkpointed block with a parameter the inner
/// forward does not use.
#[memsave::model]
#[derive(Module, Debug)]
pub struct InnerUnused<B: Backend> {
    used: Conv2d<B>,
    unused: Param<Tensor<B, 1>>,
    with_cp: bool,
}

impl<B: memsave::Backend> InnerUnused<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.used.forward(x)
    }
}

#[memsave::model]
#[derive(Module, Debug)]
pub struct OuterOfUnused<B: Backend> {
    inner: InnerUnused<B>,
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> OuterOfUnused<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(self.inner.forward(x))
    }
}

#[test]
fn nested_segments_with_an_unused_inner_parameter_match_plain() {
    watchdog(60, || {
        let device = Default::default();
        let plain = OuterOfUnused::<AB> {
            inner: InnerUnused {
                used: conv(&device),
                unused: Param::from_tensor(Tensor::ones([3], &device)),
                with_cp: false,
            },
            conv: conv(&device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let mut nested = set_with_cp(plain.clone(), true);
        nested.inner.with_cp = true;
        let x = randn([2, 4, 5, 5]).require_grad();
        let g_plain = plain.forward(x.clone()).sum().backward();
        let g_cp = nested.forward(x.clone()).sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        assert!(nested.inner.unused.grad(&g_cp).is_none());
        assert!(plain.inner.unused.grad(&g_plain).is_none());
        assert_same_grads(
            &param_grads(&nested, &g_cp),
            &param_grads(&plain, &g_plain),
            1e-6,
        );
        assert!(compare("x", x.grad(&g_cp), x.grad(&g_plain)) <= 1e-6);
    });
}

/// Every level's module is the whole `Vec` of layers; level `k` runs layer `k` and hands the
/// rest to level `k + 1`, checkpointed in turn: four segments nested in each other.
#[derive(Module, Debug)]
pub struct Suffix<B: Backend> {
    layers: Vec<Linear<B>>,
}

fn suffix_forward<B: memsave::Backend>(
    layers: &Suffix<B>,
    x: Tensor<B, 2>,
    from: usize,
    checkpointed: bool,
) -> Tensor<B, 2> {
    if from == layers.layers.len() {
        return x;
    }
    let run = move |module: &Suffix<B>, x: Tensor<B, 2>| {
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
fn four_nested_levels_over_the_whole_vec_match_plain() {
    let worst = watchdog(120, || {
        let device = Default::default();
        let model = Suffix::<AB> {
            layers: (0..4)
                .map(|_| LinearConfig::new(6, 6).init(&device))
                .collect(),
        }
        .map(&mut Materialise);
        let x =
            Tensor::<AB, 2>::random([3, 6], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let g_plain = suffix_forward(&model, x.clone(), 0, false).sum().backward();
        let g_cp = suffix_forward(&model, x.clone(), 0, true).sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        let a = values(x.grad(&g_cp).unwrap());
        let b = values(x.grad(&g_plain).unwrap());
        let dx = common::max_relative_difference(&a, &b);
        assert!(dx <= 1e-6, "{dx}");
        dx.max(assert_same_grads(
            &param_grads(&model, &g_cp),
            &param_grads(&model, &g_plain),
            1e-6,
        ))
    });
    eprintln!("4 nested levels: max relative difference {worst:e}");
}

// ---------------------------------------------------------------------------------------------
// 2. Tracked tensors that enter a segment other than as its input or a parameter.

#[memsave::model]
#[derive(Module, Debug)]
pub struct Plain<B: Backend> {
    conv: Conv2d<B>,
}

#[test]
fn a_closure_that_captures_a_tracked_tensor_gets_its_gradient_and_does_not_hang() {
    watchdog(60, || {
        let device = Default::default();
        let model = Plain::<AB> {
            conv: conv(&device),
        }
        .map(&mut Materialise);
        let x = randn([1, 4, 4, 4]).require_grad();
        let w = randn([1, 4, 4, 4]);
        let step = |checkpointed: bool| {
            let h = x.clone() * 2.0;
            let captured = h.clone();
            let run = move |m: &Plain<AB>, x: Tensor<AB, 4>| m.conv.forward(x) + captured.clone();
            let y = if checkpointed {
                checkpoint(&model, x.clone(), run)
            } else {
                run(&model, x.clone())
            };
            (y * w.clone()).sum().backward()
        };
        let g_plain = step(false);
        let g_cp = step(true);
        memsave::checkpoint::join_helpers().unwrap();
        assert!(compare("x", x.grad(&g_cp), x.grad(&g_plain)) <= 1e-6);
        assert_same_grads(
            &param_grads(&model, &g_cp),
            &param_grads(&model, &g_plain),
            1e-6,
        );
        assert!(uncheckpointed_segments()
            .iter()
            .any(|name| name.starts_with("Plain")));
    });
}

#[test]
fn a_closure_that_captures_a_leaf_gives_it_its_gradient() {
    watchdog(60, || {
        let device = Default::default();
        let model = Plain::<AB> {
            conv: conv(&device),
        }
        .map(&mut Materialise);
        let x = randn([1, 4, 4, 4]).require_grad();
        let scale = randn([1, 4, 4, 4]).require_grad();
        let step = |checkpointed: bool| {
            let captured = scale.clone();
            let run = move |m: &Plain<AB>, x: Tensor<AB, 4>| m.conv.forward(x) * captured.clone();
            let y = if checkpointed {
                checkpoint(&model, x.clone(), run)
            } else {
                run(&model, x.clone())
            };
            y.sum().backward()
        };
        let g_plain = step(false);
        let g_cp = step(true);
        memsave::checkpoint::join_helpers().unwrap();
        let d = compare("scale", scale.grad(&g_cp), scale.grad(&g_plain));
        assert!(d <= 1e-6, "{d}");
        assert!(compare("x", x.grad(&g_cp), x.grad(&g_plain)) <= 1e-6);
    });
}

/// A bare tensor field: Burn treats it as a constant, not a parameter.
#[memsave::model]
#[derive(Module, Debug)]
pub struct BareField<B: Backend> {
    conv: Conv2d<B>,
    bias: Tensor<B, 4>,
    with_cp: bool,
}

impl<B: memsave::Backend> BareField<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(x) + self.bias.clone()
    }
}

#[test]
fn a_bare_tensor_field_holding_a_tracked_tensor_gets_its_gradient() {
    watchdog(60, || {
        let device = Default::default();
        let bias = randn([1, 4, 4, 4]).require_grad();
        let plain = BareField::<AB> {
            conv: conv(&device),
            bias: bias.clone(),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let x = randn([1, 4, 4, 4]).require_grad();
        let g_plain = plain.forward(x.clone()).sum().backward();
        let g_cp = checkpointed.forward(x.clone()).sum().backward();
        memsave::checkpoint::join_helpers().unwrap();
        assert!(compare("bias", bias.grad(&g_cp), bias.grad(&g_plain)) <= 1e-6);
        assert!(compare("x", x.grad(&g_cp), x.grad(&g_plain)) <= 1e-6);
        assert!(uncheckpointed_segments()
            .iter()
            .any(|name| name == "BareField::forward"));
    });
}

// ---------------------------------------------------------------------------------------------
// 3. The macro: names that collide with generated code, trait impls.

#[memsave::model]
#[derive(Module, Debug)]
pub struct Named<B: Backend> {
    conv: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Named<B> {
    /// Arguments named like the generated code's own names.
    #[with_cp]
    fn forward(
        &self,
        this: Tensor<B, 4>,
        __this: Tensor<B, 4>,
        __segment: Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        let __arg0 = this + __this;
        self.conv.forward(__arg0) + __segment
    }
}

#[test]
fn arguments_named_like_generated_code_compile_and_work() {
    watchdog(60, || {
        let device = Default::default();
        let plain = Named::<AB> {
            conv: conv(&device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = set_with_cp(plain.clone(), true);
        let [a, b, c] = [0; 3].map(|_| randn([1, 4, 3, 3]).require_grad());
        let g_plain = plain
            .forward(a.clone(), b.clone(), c.clone())
            .sum()
            .backward();
        let before = recomputations();
        let g_cp = checkpointed
            .forward(a.clone(), b.clone(), c.clone())
            .sum()
            .backward();
        assert_eq!(recomputations() - before, 1);
        memsave::checkpoint::join_helpers().unwrap();
        for t in [&a, &b, &c] {
            assert!(compare("input", t.grad(&g_cp), t.grad(&g_plain)) <= 1e-6);
        }
    });
}

/// A block behind a trait, as model zoos write them.
pub trait Layer<B: Backend> {
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4>;
}

#[memsave::model]
#[derive(Module, Debug)]
pub struct TraitBlock<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Layer<B> for TraitBlock<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let y = self.conv1.forward(x.clone()).tanh();
        self.conv2.forward(y) + x
    }
}

#[test]
fn with_cp_on_a_method_of_a_trait_impl_is_checkpointed() {
    watchdog(60, || {
        let device = Default::default();
        let plain = TraitBlock::<AB> {
            conv1: conv(&device),
            conv2: conv(&device),
            with_cp: false,
        }
        .map(&mut Materialise);
        let checkpointed = plain.clone().set_with_cp(true);
        let x = randn([2, 4, 4, 4]).require_grad();
        let g_plain = Layer::forward(&plain, x.clone()).sum().backward();
        let before = recomputations();
        let g_cp = Layer::forward(&checkpointed, x.clone()).sum().backward();
        assert_eq!(recomputations() - before, 1);
        memsave::checkpoint::join_helpers().unwrap();
        assert_same_grads(
            &param_grads(&checkpointed, &g_cp),
            &param_grads(&plain, &g_plain),
            0.0,
        );
    });
}
