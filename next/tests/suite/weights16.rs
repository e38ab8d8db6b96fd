//! 16-bit weights on burn-optim 0.22 (`memsave_next::weights16`): the rounding's odds and bias,
//! Kahan's carry, training an MLP whose weights are bf16 only (stochastic rounding keeps the
//! updates rounding to nearest loses), a resumed optimizer continuing bit for bit, and fp32
//! parameters stepped as the wrapped optimizer steps them.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::DType;
use memsave_common::draws::uniforms;
use memsave_macros::model;
use memsave_next::fp16::{wrap_fp16_model, Fp16, Precision};
use memsave_next::weights16::{kahan, nearest, stochastic, WeightRounding, Weights16};

use crate::common;
use common::mlp::{loss_at, train, Mlp};
use common::{device, initialized, param_bits, watchdog};

fn tensor(values: &[f32]) -> Tensor<1> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), [values.len()]),
        &Device::flex(),
    )
}

fn values(t: Tensor<1>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// The two neighbours of `x` in `dtype`, from its bits: what the tensor arithmetic must agree with.
fn neighbours(x: f32, dtype: DType) -> (f32, f32) {
    let (to, from_bits, to_bits): (fn(f32) -> f32, fn(u16) -> f32, fn(f32) -> u16) = match dtype {
        DType::BF16 => (
            |v| half::bf16::from_f32(v).to_f32(),
            |b| half::bf16::from_bits(b).to_f32(),
            |v| half::bf16::from_f32(v).to_bits(),
        ),
        _ => (
            |v| half::f16::from_f32(v).to_f32(),
            |b| half::f16::from_bits(b).to_f32(),
            |v| half::f16::from_f32(v).to_bits(),
        ),
    };
    let r = to(x);
    if r == x {
        return (r, r);
    }
    let b = to_bits(r);
    let bits = if r == 0.0 {
        1 | if x < 0.0 { 0x8000 } else { 0 }
    } else if x.abs() > r.abs() {
        b + 1
    } else {
        b - 1
    };
    (r, from_bits(bits))
}

/// Every value, draw by draw: one of its two neighbours, the farther one exactly when the draw is
/// below the distance to the nearer over the spacing (powers of two up and down, the last value
/// of a binade, negative values, subnormals and values below the smallest one).
#[test]
fn stochastic_rounding_picks_the_neighbours_with_the_right_odds() {
    let _turn = common::one_at_a_time();
    for dtype in [DType::BF16, DType::F16] {
        let mut xs = vec![
            1.0 + 1e-3,
            1.0 - 1e-3,
            -1.0 - 1e-3,
            -(1.0 - 1e-3),
            2.0 - 1e-4,
            0.3,
            -0.7,
            1e-3,
            123.456,
            0.0,
            1.5,
        ];
        let tiny = match dtype {
            DType::BF16 => (2f32).powi(-130) * 1.3,
            _ => (2f32).powi(-20) * 1.3,
        };
        xs.extend([tiny, -tiny, tiny / 200.0]);
        for (k, &x) in xs.iter().enumerate() {
            let (r, other) = neighbours(x, dtype);
            let p = if r == other {
                0.0
            } else {
                ((x - r).abs() / (other - r).abs()) as f64
            };
            for u in [0.0f32, 0.25, 0.5, 0.75, 0.999] {
                let got = values(stochastic(tensor(&[x]), tensor(&[u]), dtype))[0];
                let want = if (u as f64) < p { other } else { r };
                assert_eq!(got, want, "{dtype:?} x={x} (case {k}) u={u} p={p}");
            }
        }
    }
}

/// Over many draws the mean of the rounded values is the fp32 value, where rounding to nearest
/// is off by the whole rounding error.
#[test]
fn stochastic_rounding_is_unbiased() {
    let _turn = common::one_at_a_time();
    let x = 1.0f32 + 3.0 / 1024.0; // between bf16's 1.0 and 1.0078125
    let n = 20_000;
    let rounded = values(stochastic(
        tensor(&vec![x; n]),
        tensor(&uniforms(7, 0, n)),
        DType::BF16,
    ));
    let mean = rounded.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
    assert!(
        (mean - x as f64).abs() < (1.0 / 128.0) * 0.02,
        "mean {mean} for {x}"
    );
    assert_eq!(values(nearest(tensor(&[x]), DType::BF16))[0], 1.0);
}

/// Kahan's carry keeps updates smaller than half a spacing: a hundred of them move the weight
/// where rounding to nearest leaves it where it was.
#[test]
fn kahan_keeps_updates_below_the_spacing() {
    let _turn = common::one_at_a_time();
    let (mut w, mut plain, mut carry) = (tensor(&[1.0]), tensor(&[1.0]), tensor(&[0.0]));
    for _ in 0..100 {
        let new = w.clone().add_scalar(1e-4);
        let (stored, c) = kahan(w, new, carry, DType::BF16);
        w = stored;
        carry = nearest(c, DType::BF16);
        plain = nearest(plain.clone().add_scalar(1e-4), DType::BF16);
    }
    assert_eq!(values(plain)[0], 1.0);
    let moved = values(w)[0] + values(carry)[0];
    assert!((moved - 1.01).abs() < 1e-3, "{moved}");
}

fn mlp() -> Mlp {
    Mlp::new(&device(), [16, 32, 4])
}

/// AdamW at lr 1e-4 on weights kept in bf16 only: its updates are mostly below half of bf16's
/// spacing, so rounding to nearest loses them; stochastic rounding and Kahan's compensation keep
/// the fp32 run's progress.
#[test]
fn bf16_weights_keep_the_updates_rounding_to_nearest_loses() {
    watchdog(300, || {
        device().seed(8);
        let fp32 = initialized(mlp());
        let start = loss_at(&fp32, 0).into_scalar::<f32>();
        let steps = 0..60;
        let (_, reference) = train(
            fp32.clone(),
            &mut AdamWConfig::new().init(),
            1e-4,
            steps.clone(),
        );
        let progress = |rounding: WeightRounding| {
            let bf16 = wrap_fp16_model(fp32.clone(), Precision::Bf16);
            // From the bf16 model's own first loss (its weights are the fp32 ones rounded).
            let own_start = loss_at(&bf16, 0).into_scalar::<f32>();
            let mut optimizer = Weights16::new(AdamWConfig::new().build())
                .with_rounding(rounding)
                .init();
            let (model, loss) = train(bf16, &mut optimizer, 1e-4, steps.clone());
            assert_eq!(
                model.fc1.weight.val().dtype(),
                DType::BF16,
                "the weights stay bf16"
            );
            (own_start - loss) / (start - reference)
        };
        let (stochastic, kahan, nearest) = (
            progress(WeightRounding::Stochastic),
            progress(WeightRounding::Kahan),
            progress(WeightRounding::Nearest),
        );
        eprintln!(
            "loss {start:.5} -> fp32 {reference:.5}; progress against fp32: stochastic \
             {stochastic:.3}, kahan {kahan:.3}, nearest {nearest:.3}"
        );
        assert!(reference < start);
        assert!(stochastic > 0.8 && kahan > 0.8, "{stochastic} {kahan}");
        assert!(
            nearest < 0.5 * stochastic,
            "nearest {nearest}, stochastic {stochastic}"
        );
    });
}

/// An optimizer saved after 3 steps and resumed continues with the bits of the run that never
/// stopped: the stochastic draws and Kahan's carries come back with its state.
#[test]
fn a_resumed_optimizer_continues_bit_for_bit() {
    watchdog(300, || {
        for rounding in [WeightRounding::Stochastic, WeightRounding::Kahan] {
            let fresh = || {
                Weights16::new(AdamWConfig::new().build())
                    .with_rounding(rounding)
                    .with_seed(3)
                    .init()
            };
            device().seed(9);
            let model = wrap_fp16_model(initialized(mlp()), Precision::Bf16);
            let (straight, _) = train(model.clone(), &mut fresh(), 1e-3, 0..6);
            let mut first = fresh();
            let (half, _) = train(model, &mut first, 1e-3, 0..3);
            let bytes = first.into_bytes().expect("the record writes");
            let mut resumed = fresh().from_bytes(bytes).expect("the record reads");
            let (resumed, _) = train(half, &mut resumed, 1e-3, 3..6);
            assert_eq!(param_bits(&resumed), param_bits(&straight), "{rounding}");
        }
    });
}

/// Parameters kept in fp32 (an island's, or a model not compressed) are stepped by the wrapped
/// rule, bit for bit.
#[test]
fn fp32_parameters_are_stepped_as_the_wrapped_optimizer_steps_them() {
    watchdog(300, || {
        device().seed(10);
        let model = initialized(mlp());
        let (ours, _) = train(
            model.clone(),
            &mut Weights16::new(AdamWConfig::new().build()).init(),
            1e-3,
            0..4,
        );
        let (burns, _) = train(model, &mut AdamWConfig::new().init(), 1e-3, 0..4);
        assert_eq!(param_bits(&ours), param_bits(&burns));
    });
}

/// A parameter larger than the rounding's slice (600 x 600, 360,000 values) takes draw `i` of its
/// stream for value `i`, as one whole rounding would: one SGD step against the rounding written
/// out (the stream of the first parameter stepped, 0, at step 0, seed 5: 0.21's key).
#[test]
fn a_large_parameter_is_rounded_in_slices_as_a_whole() {
    use memsave_common::draws::splitmix64;
    watchdog(300, || {
        device().seed(11);
        let layer: Linear =
            initialized(LinearConfig::new(600, 600).with_bias(false).init(&device()));
        let layer = wrap_fp16_model(layer, Precision::Bf16);
        let x = Tensor::<2>::ones([2, 600], &device()).cast(DType::BF16);
        let loss = layer.forward(x).cast(DType::F32).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        let grad = grads.get::<2>(layer.weight.id).unwrap();
        let old = layer.weight.val().inner().cast(DType::F32);
        let expected_new = old - grad.cast(DType::F32).mul_scalar(0.1);
        let n = 600 * 600;
        let key = splitmix64(5 ^ splitmix64(0 ^ splitmix64(0)));
        let u = Tensor::<1>::from_data(TensorData::new(uniforms(key, 0, n), [n]), &Device::flex())
            .reshape([600, 600]);
        let expected = stochastic(expected_new, u, DType::BF16).cast(DType::BF16);

        let mut optimizer = Weights16::new(burn::optim::SgdConfig::new().build())
            .with_seed(5)
            .init();
        let stepped = optimizer.step(0.1, layer, grads);
        assert_eq!(
            common::bits(stepped.weight.val()),
            common::bits(expected),
            "the sliced rounding against the whole"
        );
    });
}

/// A model half bf16, half an fp32 island: the island's weights stay fp32 and move by the wrapped
/// rule, the others stay bf16.
#[model]
#[derive(Module, Debug)]
struct Mixed {
    fc1: Linear,
    #[fp16(fp32)]
    fc2: Linear,
    fp16_enabled: Fp16,
}

#[test]
fn an_fp32_island_in_a_bf16_model_keeps_fp32_weights() {
    watchdog(300, || {
        device().seed(12);
        let model = Mixed {
            fc1: LinearConfig::new(8, 8).init(&device()),
            fc2: LinearConfig::new(8, 2).init(&device()).into(),
            fp16_enabled: Fp16::Off,
        };
        let model = wrap_fp16_model(initialized(model), Precision::Bf16);
        let before = param_bits(&model);
        let mut optimizer = Weights16::new(AdamWConfig::new().build()).init();
        let x = Tensor::<2>::ones([4, 8], &device()).cast(DType::BF16);
        let out = model.fc2.forward(model.fc1.forward(x));
        let grads = GradientsParams::from_grads(out.cast(DType::F32).sum().backward(), &model);
        let model = optimizer.step(1e-2, model, grads);
        assert_eq!(model.fc1.weight.val().dtype(), DType::BF16);
        assert_eq!(model.fc2.inner().weight.val().dtype(), DType::F32);
        assert_ne!(param_bits(&model), before, "both moved");
    });
}

/// Each step counts the updates that left their 16-bit weight where it was: against the count
/// read off the tensors themselves (the wrapped rule's fp32 result and the stored weight), for
/// every rounding and both 16-bit types, on a weight whose updates are partly below half its
/// spacing.
#[test]
fn a_step_counts_the_updates_that_left_their_weight_unchanged() {
    use burn::optim::Optimizer;
    use memsave_next::weights16::{count_step_rounding, take_step_rounding};
    watchdog(300, || {
        // Counted where asked for (the optimizer hook and burn-train's adapter ask).
        let before = count_step_rounding(false);
        let _ = take_step_rounding();
        let weight = Tensor::<1>::ones([8], &Device::flex()).cast(DType::BF16);
        let grad = Tensor::<1>::ones([8], &Device::flex()).cast(DType::BF16);
        let _ = Weights16::new(AdamWConfig::new().build()).step(1e-3, weight, grad, None);
        assert!(
            take_step_rounding().is_none(),
            "counted without being asked"
        );
        count_step_rounding(true);
        let device = Device::flex();
        for dtype in [DType::BF16, DType::F16] {
            for rounding in [
                WeightRounding::Nearest,
                WeightRounding::Stochastic,
                WeightRounding::Kahan,
            ] {
                device.seed(11);
                let weight =
                    Tensor::<2>::random([48, 64], burn::tensor::Distribution::Default, &device)
                        .sub_scalar(0.5)
                        .cast(dtype);
                let grad =
                    Tensor::<2>::random([48, 64], burn::tensor::Distribution::Default, &device)
                        .sub_scalar(0.5);
                // AdamW's first step moves each value by about the rate: 2e-4 is below half the
                // spacing of the larger weights (bf16 at 0.25: 2^-9) and above the smaller ones'.
                let lr = 2e-4;
                let wrapped = AdamWConfig::new().build();
                let old = weight.clone().cast(DType::F32);
                let (new, _) = wrapped.step(lr, old.clone(), grad.clone(), None);
                let ours = Weights16::new(wrapped).with_rounding(rounding);
                let (stored, _) = ours.step(lr, weight, grad.cast(dtype), None);
                let stored = stored.cast(DType::F32);
                let moved = new.not_equal(old.clone());
                let unchanged = moved.clone().bool_and(stored.equal(old));
                let count = |mask: Tensor<2, Bool>| mask.int().sum().into_scalar::<i64>() as f64;
                let (moved, unchanged) = (count(moved), count(unchanged));
                let (figures, kind) = take_step_rounding().expect("a step was counted");
                assert_eq!(kind, rounding);
                assert_eq!(figures.moved, moved, "{dtype:?}, {rounding}");
                assert_eq!(figures.unchanged, unchanged, "{dtype:?}, {rounding}");
                assert!(
                    unchanged > 0.0 && unchanged < moved,
                    "{dtype:?}, {rounding}: {unchanged} of {moved}"
                );
                println!(
                    "{dtype:?}, {rounding}: {unchanged} of {moved} updates left their weight \
                     unchanged ({:.3}; printed, the counts asserted against the tensors)",
                    figures.fraction()
                );
                // Read once: the next step starts its own count.
                assert!(take_step_rounding().is_none());
            }
        }
        count_step_rounding(before);
    });
}

/// The runner logs each step's share of updates that left their 16-bit weight unchanged, the
/// same whether the step runs after backward or in it, and f16 weights that lose more than 1%
/// (SGD's small updates, rounded to nearest) warn once, at the first step; bf16 weights do not.
#[test]
fn the_runner_logs_the_updates_the_16_bit_weights_left_unchanged() {
    use super::in_backward::{run_hooked, Data, Setup};
    use memsave_next::hooks::OptimizerHook;
    watchdog(300, || {
        let setup = |precision| Setup {
            device: device(),
            count: 2,
            checkpointed: false,
            data: Data {
                rows: 16,
                count: 3,
                loud: vec![],
            },
            iters: 3,
            optimizer: match precision {
                Precision::F16 => || {
                    Weights16::new(burn::optim::SgdConfig::new().build())
                        .with_rounding(WeightRounding::Nearest)
                        .init()
                },
                Precision::Bf16 => || {
                    // Kahan: deterministic, as nearest (stochastic rounding draws per
                    // parameter in the order they first step, which backward reverses).
                    Weights16::new(burn::optim::SgdConfig::new().build())
                        .with_rounding(WeightRounding::Kahan)
                        .init()
                },
            },
            hook: OptimizerHook::new,
        };
        for precision in [Precision::F16, Precision::Bf16] {
            let setup = setup(precision);
            let mut shares = Vec::new();
            for in_backward in [false, true] {
                let hook = OptimizerHook::new()
                    .with_weights16(precision)
                    .with_step_in_backward(in_backward);
                let ran = run_hooked(&setup, hook, None);
                let share: Vec<Option<f64>> =
                    ran.logs.iter().map(|log| log.weights_unchanged).collect();
                println!("{precision}, in backward: {in_backward}: {share:?}");
                // At each step (f16's implied scale from 2^16 overflows first and skips one).
                assert!(ran.logs.iter().any(|log| log.stepped));
                for log in &ran.logs {
                    match log.weights_unchanged {
                        Some(share) => assert!(log.stepped && share > 0.0 && share < 1.0),
                        None => assert!(!log.stepped),
                    }
                }
                let warned = ran
                    .warnings
                    .iter()
                    .filter(|w| w.contains("of the first step's updates were lost"))
                    .count();
                assert_eq!(
                    warned,
                    usize::from(precision == Precision::F16),
                    "{:?}",
                    ran.warnings
                );
                shares.push(share);
            }
            assert_eq!(shares[0], shares[1], "{precision}: after and in backward");
        }
    });
}
