//! 8-bit optimizer state on burn-optim 0.22 (`memsave_next::optim8`, `memsave_next::quant`):
//! in fp32 the same bits as Burn's SGD, Adam and AdamW; in 8 bits a quarter of the bytes, the
//! training cost measured against fp32 state, and a resumed optimizer continuing bit for bit.

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use memsave_next::optim8::{Adam8, Sgd8};
use memsave_next::quant::{dynamic_map, StateTensor, BLOCK, MIN_ELEMENTS, UNSIGNED_FLOOR};

use crate::common;
use common::mlp::{train, Mlp};
use common::{device, initialized, watchdog};

/// Five per-tensor steps of `a` and `b` from the same tensor and gradients: the same bits.
fn same_steps<A: Optimizer, O: Optimizer>(a: &A, b: &O) {
    let device = Device::flex();
    device.seed(1);
    // 6144 values: past `MIN_ELEMENTS`, so that the fp32 path is the one a large tensor takes.
    let mut x = Tensor::<2>::random([64, 96], Distribution::Normal(0.0, 1.0), &device);
    let mut y = x.clone();
    let (mut sa, mut sb) = (None, None);
    for step in 0..5 {
        let grad = Tensor::<2>::random([64, 96], Distribution::Normal(0.0, 1.0), &device);
        let (nx, na) = a.step(0.01, x, grad.clone(), sa);
        let (ny, nb) = b.step(0.01, y, grad, sb);
        assert_eq!(
            common::bits(nx.clone()),
            common::bits(ny.clone()),
            "step {step}"
        );
        (x, y, sa, sb) = (nx, ny, na, nb);
    }
}

/// Reaches the per-tensor optimizer inside `ModuleOptimizer::from` (the builders' `init`).
fn sgd8(momentum: f64, dampening: f64, nesterov: bool, decay: f32) -> Sgd8 {
    let mut sgd = Sgd8::new().with_eight_bit(false);
    if momentum > 0.0 {
        sgd = sgd.with_momentum(momentum, dampening, nesterov);
    }
    if decay > 0.0 {
        sgd = sgd.with_weight_decay(decay);
    }
    sgd
}

#[test]
fn in_fp32_the_8_bit_optimizers_are_burns_own_bit_for_bit() {
    watchdog(120, || {
        for (momentum, dampening, nesterov, decay) in [
            (0.9, 0.0, false, 1e-4),
            (0.9, 0.1, false, 0.0),
            (0.9, 0.0, true, 0.0),
            (0.0, 0.0, false, 0.0),
        ] {
            let burn = SgdConfig::new()
                .with_momentum((momentum > 0.0).then_some(MomentumConfig {
                    momentum,
                    dampening,
                    nesterov,
                }))
                .with_weight_decay((decay > 0.0).then(|| WeightDecayConfig::new(decay)))
                .build();
            same_steps(&sgd8(momentum, dampening, nesterov, decay), &burn);
        }
        for decay in [0.0, 1e-2] {
            let burn = AdamConfig::new()
                .with_weight_decay((decay > 0.0).then(|| WeightDecayConfig::new(decay)))
                .build();
            let ours = Adam8::adam().with_weight_decay(decay).with_eight_bit(false);
            same_steps(&ours, &burn);
            let burn = AdamWConfig::new().with_weight_decay(decay).build();
            let ours = Adam8::adamw()
                .with_weight_decay(decay)
                .with_eight_bit(false);
            same_steps(&ours, &burn);
        }
    });
}

#[test]
fn values_on_the_map_round_trip_and_others_go_to_their_nearest() {
    let _turn = common::one_at_a_time();
    let device = Device::flex();
    let map = dynamic_map(true);
    // One block of 4096 values: every map value times 3 (the block's scale), repeated.
    let values: Vec<f32> = (0..4096).map(|i| map[i % 256] * 3.0).collect();
    let tensor = Tensor::<1>::from_data(TensorData::new(values.clone(), [4096]), &device);
    let stored = StateTensor::store(tensor, true, true);
    assert!(matches!(stored, StateTensor::Blocks { .. }));
    let back = floats(stored.load());
    for (a, b) in values.iter().zip(&back) {
        assert!((a - b).abs() <= 3e-7 * a.abs().max(1.0), "{a} -> {b}");
    }
    // Other values: within half the widest gap of the map (0.9 / 64 near 1), block by block.
    let mut state = 7u64;
    let values: Vec<f32> = (0..10_000)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 10.0
        })
        .collect();
    let tensor = Tensor::<2>::from_data(TensorData::new(values.clone(), [100, 100]), &device);
    let back = floats(StateTensor::store(tensor, true, true).load());
    for (block, (a, b)) in values.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
        let absmax = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            worst <= absmax * 0.9 / 64.0 / 2.0 * 1.001,
            "block {block}: {worst}"
        );
    }
}

#[test]
fn a_zero_second_moment_beside_a_large_one_is_the_floor_not_zero() {
    let _turn = common::one_at_a_time();
    let mut values = vec![0.0f32; MIN_ELEMENTS];
    values[0] = 4.0;
    values[1] = 4e-9;
    let tensor = Tensor::<1>::from_data(TensorData::new(values, [MIN_ELEMENTS]), &Device::flex());
    let back = floats(StateTensor::store(tensor, true, false).load());
    assert_eq!(back[0], 4.0);
    // Adam divides by sqrt(v) + eps: the floor times the block's scale keeps that step bounded.
    assert_eq!(back[1], UNSIGNED_FLOOR * 4.0);
    assert_eq!(back[2], UNSIGNED_FLOOR * 4.0);
    assert!(back[BLOCK..].iter().all(|v| *v <= UNSIGNED_FLOOR * 1e-12));
}

#[test]
fn small_tensors_stay_fp32_and_8_bits_take_a_quarter() {
    let _turn = common::one_at_a_time();
    let device = Device::flex();
    let small = Tensor::<1>::ones([MIN_ELEMENTS - 1], &device);
    assert!(matches!(
        StateTensor::store(small, true, true),
        StateTensor::Full(_)
    ));
    let large = Tensor::<1>::ones([1 << 16], &device);
    let stored = StateTensor::store(large, true, false);
    assert_eq!(stored.bytes(), (1 << 16) + (1 << 16) / BLOCK * 4);
    let StateTensor::Blocks { codes, .. } = &stored else {
        panic!("8 bits")
    };
    assert_eq!(codes.dtype(), DType::U8);
}

#[test]
fn wrong_settings_are_errors_naming_them() {
    let _turn = common::one_at_a_time();
    let said = |result: memsave_next::Result<ModuleOptimizer>| match result {
        Ok(_) => panic!("accepted"),
        Err(error) => error.to_string(),
    };
    assert_eq!(
        said(Adam8::adam().with_betas(0.9, 1.5).init()),
        "invalid value for `beta_2`: must be in [0, 1), got 1.5"
    );
    assert!(said(Adam8::adamw().with_epsilon(0.0).init()).contains("`epsilon`"));
    assert!(said(Adam8::adam().with_weight_decay(-1.0).init()).contains("`weight_decay`"));
    assert!(said(Sgd8::new().with_momentum(1.2, 0.0, false).init()).contains("`momentum`"));
    assert!(said(Sgd8::new().with_momentum(0.9, 0.1, true).init()).contains("`nesterov`"));
    assert!(said(Sgd8::new().with_momentum(0.0, 0.1, false).init()).contains("`dampening`"));
}

/// A model large enough for 8-bit state: 64 x 96 weights (6144 values, past `MIN_ELEMENTS`).
fn mlp() -> Mlp {
    Mlp::new(&device(), [64, 96, 8])
}

/// AdamW with 8-bit moments trains the MLP to the loss of fp32 moments within 2%.
#[test]
fn adamw_in_8_bits_trains_as_fp32_state_does() {
    watchdog(300, || {
        device().seed(2);
        let model = initialized(mlp());
        let (_, fp32) = train(model.clone(), &mut AdamWConfig::new().init(), 1e-3, 0..60);
        let (_, eight) = train(
            model.clone(),
            &mut Adam8::adamw().init().unwrap(),
            1e-3,
            0..60,
        );
        let (_, start) = train(model, &mut AdamWConfig::new().init(), 1e-3, 0..1);
        eprintln!("loss: start {start:.6}, fp32 state {fp32:.6}, 8-bit state {eight:.6}");
        assert!(fp32 < 0.6 * start, "it learns: {start} -> {fp32}");
        assert!(
            (eight - fp32).abs() <= 0.02 * fp32,
            "8-bit {eight} against fp32 {fp32}"
        );
        assert_ne!(eight, fp32, "the state really is 8-bit");
    });
}

/// The optimizer's record holds the 8-bit state as it is: a run resumed from it continues with
/// the same bits as the run that never stopped.
#[test]
fn a_resumed_8_bit_optimizer_continues_bit_for_bit() {
    watchdog(300, || {
        for optimizer in [
            Adam8::adamw().init().unwrap(),
            Sgd8::new().with_momentum(0.9, 0.0, false).init().unwrap(),
        ] {
            device().seed(3);
            let model = initialized(mlp());
            let mut whole = optimizer.clone();
            let (straight, _) = train(model.clone(), &mut whole, 1e-3, 0..6);

            let mut first = optimizer.clone();
            let (half, _) = train(model, &mut first, 1e-3, 0..3);
            let bytes = first.into_bytes().expect("the record writes");
            let mut resumed = optimizer.from_bytes(bytes).expect("the record reads");
            let (resumed_model, _) = train(half, &mut resumed, 1e-3, 3..6);
            assert_eq!(
                common::param_bits(&resumed_model),
                common::param_bits(&straight)
            );
        }
    });
}

fn floats<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
}
