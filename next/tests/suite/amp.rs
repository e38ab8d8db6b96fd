//! Mixed precision in a user's own loop on Burn 0.22 (`memsave_next::amp`): fp32 masters, the
//! forward on a half copy, the loss scaled; against the same step written by hand, with an
//! overflow skipped, gradients that underflow f16 kept by the scale, and global-norm clipping.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;
use memsave_next::amp::MixedPrecision;
use memsave_next::fp16::{wrap_fp16_model, Precision};
use memsave_next::grads::{global_norm, GradClip};
use memsave_next::scaler::{LossScaler, ScaleMode};

use crate::common;
use common::mlp::{batch, Mlp};
use common::{device, initialized, watchdog};

fn mlp() -> Mlp {
    Mlp::new(&device(), [6, 16, 3])
}

fn input(step: usize, scale: f32) -> (Tensor<2>, Tensor<2>) {
    batch(&device(), 8, [6, 3], [step, step + 5], scale)
}

fn loss(model: &Mlp, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    model.loss(x, y)
}

/// The step of mixed precision written out by hand: the half copy, the loss times `scale` in
/// fp32, the half gradients cast to fp32 and divided by `scale`, Adam on the masters.
fn by_hand(steps: usize, scale: f64) -> Vec<Vec<u32>> {
    struct ToF32<'a>(&'a mut GradientsParams, f64);
    impl ModuleVisitor for ToF32<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.remove::<D>(param.id) {
                let grad = grad.cast(DType::F32).mul_scalar(1.0 / self.1);
                self.0.register::<D>(param.id, grad);
            }
        }
    }
    device().seed(3);
    let mut masters = initialized(mlp());
    let mut optimizer = AdamConfig::new().init();
    for step in 0..steps {
        let half = wrap_fp16_model(masters.clone(), Precision::F16);
        let (x, y) = input(step, 1.0);
        let grads = loss(&half, x, y).mul_scalar(scale).backward();
        let mut grads = GradientsParams::from_grads(grads, &half);
        masters.visit(&mut ToF32(&mut grads, scale));
        masters = optimizer.step(1e-2, masters, grads);
    }
    common::param_bits(&masters)
}

#[test]
fn steps_are_the_hand_written_mixed_precision_step_bit_for_bit() {
    watchdog(300, || {
        let scale = 256.0;
        device().seed(3);
        let mut masters = initialized(mlp());
        let mut optimizer = AdamConfig::new().init();
        let mut amp = MixedPrecision::new(
            Precision::F16,
            LossScaler::new(scale, ScaleMode::Static, 2.0, 1000).unwrap(),
        );
        for step in 0..5 {
            let half = amp.half_model(&masters);
            assert_eq!(half.fc1.weight.val().dtype(), DType::F16);
            let (x, y) = input(step, 1.0);
            let grads = amp.backward(loss(&half, x, y));
            let (stepped, report) = amp.step(&mut optimizer, 1e-2, masters, &half, grads);
            masters = stepped;
            assert!(!report.skipped && report.loss_scale == scale, "{report:?}");
        }
        assert_eq!(masters.fc1.weight.val().dtype(), DType::F32, "fp32 masters");
        assert_eq!(common::param_bits(&masters), by_hand(5, scale));
        // The scale is read: another scale is another computation (the hand-written step with a
        // scale of 1 rounds differently in f16).
        assert_ne!(common::param_bits(&masters), by_hand(5, 1.0 / 1024.0));
    });
}

#[test]
fn an_overflow_skips_the_step_and_the_scale_backs_off_then_grows() {
    watchdog(300, || {
        device().seed(4);
        let masters = initialized(mlp());
        let mut optimizer = SgdConfig::new().init();
        // Window 2: two clean steps double the scale.
        let scaler = LossScaler::new(65536.0, ScaleMode::Dynamic, 2.0, 2).unwrap();
        let mut amp = MixedPrecision::new(Precision::F16, scaler);
        let before = common::param_bits(&masters);

        // Inputs of 100: the loss is about 1e4, its gradient times 65536 is past f16's 65504.
        let half = amp.half_model(&masters);
        let (x, y) = input(0, 100.0);
        let grads = amp.backward(loss(&half, x, y));
        let (masters, report) = amp.step(&mut optimizer, 0.1, masters, &half, grads);
        assert!(report.skipped, "{report:?}");
        assert!(!report.grad_norm.unwrap().is_finite());
        assert_eq!(
            common::param_bits(&masters),
            before,
            "a skipped step changes no weight"
        );
        assert_eq!(amp.scaler().loss_scale(), 32768.0);

        let mut masters = masters;
        let mut scales = Vec::new();
        for step in 1..4 {
            let half = amp.half_model(&masters);
            let (x, y) = input(step, 0.5);
            let grads = amp.backward(loss(&half, x, y));
            let (stepped, report) = amp.step(&mut optimizer, 0.1, masters, &half, grads);
            masters = stepped;
            assert!(!report.skipped, "step {step}: {report:?}");
            scales.push(amp.scaler().loss_scale());
        }
        assert_ne!(common::param_bits(&masters), before);
        // MMCV's rule: `scale_window` clean updates after the overflow double the scale.
        assert_eq!(scales, [32768.0, 65536.0, 65536.0]);
    });
}

/// A loss so small that its gradients underflow f16: with a scale of 1 the half gradients are
/// zeros and nothing learns; with 2^20 they are fp32's within 1e-2.
#[test]
fn the_scale_keeps_gradients_that_underflow_f16() {
    watchdog(300, || {
        device().seed(5);
        let masters = initialized(mlp());
        let tiny = |model: &Mlp| {
            let (x, y) = input(0, 1.0);
            loss(model, x, y).mul_scalar(1e-7)
        };
        let reference = {
            let grads = GradientsParams::from_grads(tiny(&masters).backward(), &masters);
            global_norm(&masters, &grads, 2.0).unwrap()
        };
        let norm_with = |scale: f64| {
            let scaler = LossScaler::new(scale, ScaleMode::Static, 2.0, 1000).unwrap();
            let mut amp = MixedPrecision::new(Precision::F16, scaler);
            let half = amp.half_model(&masters);
            let grads = amp.backward(tiny(&half));
            let mut optimizer = SgdConfig::new().init();
            let (_, report) = amp.step(&mut optimizer, 0.1, masters.clone(), &half, grads);
            report.grad_norm.unwrap()
        };
        let (unscaled, scaled) = (norm_with(1.0), norm_with(1048576.0));
        eprintln!(
            "fp32 {reference:.3e}, f16 unscaled {unscaled:.3e}, f16 scaled by 2^20 {scaled:.3e}"
        );
        assert!(
            unscaled < 0.5 * reference,
            "unscaled: {unscaled} against {reference}"
        );
        assert!(
            (scaled - reference).abs() < 1e-2 * reference,
            "scaled: {scaled} against {reference}"
        );
    });
}

/// Clipping by the global norm of the unscaled gradients: SGD at lr 1 moves the weights by the
/// clipped gradients, whose norm is `max_norm`; the report gives the norm before clipping.
#[test]
fn clipping_limits_the_global_norm_of_the_unscaled_gradients() {
    watchdog(300, || {
        device().seed(6);
        let masters = initialized(mlp());
        let clip = GradClip::new(0.01, 2.0).unwrap();
        let mut amp = MixedPrecision::for_precision(Precision::Bf16).with_grad_clip(clip);
        assert_eq!(amp.scaler().loss_scale(), 1.0, "bf16: no scaling");
        let half = amp.half_model(&masters);
        let (x, y) = input(0, 1.0);
        let grads = amp.backward(loss(&half, x, y));
        let mut optimizer = SgdConfig::new().init();
        let before = masters.clone();
        let (after, report) = amp.step(&mut optimizer, 1.0, masters, &half, grads);
        let norm = report.grad_norm.unwrap();
        assert!(
            norm > 0.01,
            "the gradients must be larger than the clip: {norm}"
        );
        let moved = [
            (before.fc1.weight.val() - after.fc1.weight.val())
                .square()
                .sum(),
            (before.fc2.weight.val() - after.fc2.weight.val())
                .square()
                .sum(),
            (before.fc1.bias.as_ref().unwrap().val() - after.fc1.bias.as_ref().unwrap().val())
                .square()
                .sum(),
            (before.fc2.bias.as_ref().unwrap().val() - after.fc2.bias.as_ref().unwrap().val())
                .square()
                .sum(),
        ]
        .into_iter()
        .map(|part| part.into_scalar::<f32>() as f64)
        .sum::<f64>()
        .sqrt();
        assert!((moved - 0.01).abs() < 1e-4, "moved by {moved}");
    });
}

/// The infinity norm is the largest magnitude; a model without gradients has no norm.
#[test]
fn global_norm_of_each_type() {
    // Under the watchdog's turn: building the model draws from Flex's one random stream,
    // which the other tests seed.
    watchdog(120, || {
        let model: Linear = initialized(LinearConfig::new(2, 2).init(&device()));
        let mut grads = GradientsParams::new();
        grads.register::<2>(
            model.weight.id,
            Tensor::from_data([[3.0, -4.0], [0.0, 0.0]], &Device::flex()),
        );
        assert_eq!(global_norm(&model, &grads, 2.0), Some(5.0));
        assert_eq!(global_norm(&model, &grads, f64::INFINITY), Some(4.0));
        assert_eq!(global_norm(&model, &grads, 1.0), Some(7.0));
        assert_eq!(global_norm(&model, &GradientsParams::new(), 2.0), None);
        // A NaN or an inf in a later parameter's gradient makes every norm not finite (the overflow
        // test): `max` of a finite total and a NaN part would keep the total.
        for bad in [f32::NAN, f32::INFINITY] {
            let mut grads = GradientsParams::new();
            grads.register::<2>(
                model.weight.id,
                Tensor::from_data([[3.0, -4.0], [0.0, 0.0]], &Device::flex()),
            );
            grads.register::<1>(
                model.bias.as_ref().unwrap().id,
                Tensor::from_data([bad, 1.0], &Device::flex()),
            );
            for norm_type in [2.0, 1.0, f64::INFINITY] {
                let norm = global_norm(&model, &grads, norm_type).unwrap();
                assert!(!norm.is_finite(), "{bad} with p = {norm_type}: {norm}");
            }
        }
    });
}
