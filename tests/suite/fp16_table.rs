//! REFERENCE.md section 1, MMCV's own cases: each row of the table as its own test, flag off and
//! flag on, on real f16 (and bf16) tensors on Flex.

use burn::backend::Flex;
use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::DType;
use memsave::fp16::{Fp16, Precision};
use memsave::{auto_fp16, force_fp32};

type B = Flex;

#[memsave::model]
#[derive(Module, Debug)]
struct Table<B: Backend> {
    weight: Param<Tensor<B, 1>>,
    fp16_enabled: Fp16,
}

type T = Tensor<B, 1>;

impl Table<B> {
    fn new(fp16_enabled: Fp16) -> Self {
        Table {
            weight: Param::from_tensor(Tensor::ones([1], &Default::default())),
            fp16_enabled,
        }
    }

    #[auto_fp16]
    fn auto_all(&self, x: T, y: T) -> (T, T) {
        (x, y)
    }

    #[auto_fp16(apply_to = (x))]
    fn auto_x(&self, x: T, y: T) -> (T, T) {
        (x, y)
    }

    #[auto_fp16(apply_to = (x, y))]
    fn auto_xy(&self, x: T, y: T, z: T) -> (T, T, T) {
        (x, y, z)
    }

    #[auto_fp16(apply_to = (x, y), out_fp32)]
    fn auto_xy_out(&self, x: T, y: T, z: T) -> (T, T, T) {
        (x, y, z)
    }

    #[force_fp32]
    fn force_all(&self, x: T, y: T) -> (T, T) {
        (x, y)
    }

    #[force_fp32(args = (x))]
    fn force_x(&self, x: T, y: T) -> (T, T) {
        (x, y)
    }

    #[force_fp32(args = (x, y))]
    fn force_xy(&self, x: T, y: T, z: T) -> (T, T, T) {
        (x, y, z)
    }

    #[force_fp32(args = (x, y), out_fp16)]
    fn force_xy_out(&self, x: T, y: T, z: T) -> (T, T, T) {
        (x, y, z)
    }
}

fn tensor(dtype: DType) -> T {
    Tensor::<B, 1>::from_floats([0.5, -1.25, 3.0], &Default::default()).cast(dtype)
}

const F32: DType = DType::F32;
const F16: DType = DType::F16;
const BF16: DType = DType::BF16;
const ON: Fp16 = Fp16::On(Precision::F16);

fn dtypes2((a, b): (T, T)) -> [DType; 2] {
    [a.dtype(), b.dtype()]
}

fn dtypes3((a, b, c): (T, T, T)) -> [DType; 3] {
    [a.dtype(), b.dtype(), c.dtype()]
}

#[test]
fn auto_fp16_casts_every_argument() {
    let off = Table::new(Fp16::Off).auto_all(tensor(F32), tensor(F32));
    assert_eq!(dtypes2(off), [F32, F32]);
    let on = Table::new(ON).auto_all(tensor(F32), tensor(F32));
    assert_eq!(dtypes2(on), [F16, F16]);
}

#[test]
fn auto_fp16_apply_to_x_casts_only_x() {
    let off = Table::new(Fp16::Off).auto_x(tensor(F32), tensor(F32));
    assert_eq!(dtypes2(off), [F32, F32]);
    let on = Table::new(ON).auto_x(tensor(F32), tensor(F32));
    assert_eq!(dtypes2(on), [F16, F32]);
}

#[test]
fn auto_fp16_apply_to_xy_leaves_z() {
    let off = Table::new(Fp16::Off).auto_xy(tensor(F32), tensor(F32), tensor(F32));
    assert_eq!(dtypes3(off), [F32, F32, F32]);
    let on = Table::new(ON).auto_xy(tensor(F32), tensor(F32), tensor(F32));
    assert_eq!(dtypes3(on), [F16, F16, F32]);
}

#[test]
fn auto_fp16_out_fp32_casts_the_output_back() {
    let off = Table::new(Fp16::Off).auto_xy_out(tensor(F16), tensor(F32), tensor(F32));
    assert_eq!(dtypes3(off), [F16, F32, F32]);
    let on = Table::new(ON).auto_xy_out(tensor(F16), tensor(F32), tensor(F32));
    assert_eq!(dtypes3(on), [F32, F32, F32]);
}

#[test]
fn force_fp32_casts_every_argument() {
    let off = Table::new(Fp16::Off).force_all(tensor(F16), tensor(F16));
    assert_eq!(dtypes2(off), [F16, F16]);
    let on = Table::new(ON).force_all(tensor(F16), tensor(F16));
    assert_eq!(dtypes2(on), [F32, F32]);
}

#[test]
fn force_fp32_args_x_casts_only_x() {
    let off = Table::new(Fp16::Off).force_x(tensor(F16), tensor(F16));
    assert_eq!(dtypes2(off), [F16, F16]);
    let on = Table::new(ON).force_x(tensor(F16), tensor(F16));
    assert_eq!(dtypes2(on), [F32, F16]);
}

#[test]
fn force_fp32_args_xy_leaves_z() {
    let off = Table::new(Fp16::Off).force_xy(tensor(F16), tensor(F16), tensor(F16));
    assert_eq!(dtypes3(off), [F16, F16, F16]);
    let on = Table::new(ON).force_xy(tensor(F16), tensor(F16), tensor(F16));
    assert_eq!(dtypes3(on), [F32, F32, F16]);
}

#[test]
fn force_fp32_out_fp16_casts_the_output_back() {
    let off = Table::new(Fp16::Off).force_xy_out(tensor(F32), tensor(F16), tensor(F16));
    assert_eq!(dtypes3(off), [F32, F16, F16]);
    let on = Table::new(ON).force_xy_out(tensor(F32), tensor(F16), tensor(F16));
    assert_eq!(dtypes3(on), [F16, F16, F16]);
}

#[test]
fn values_survive_the_round_trip_exactly() {
    // 0.5, -1.25 and 3.0 are exact in f16 and bf16: casting must not change them.
    let (x, y) = Table::new(ON).auto_all(tensor(F32), tensor(F32));
    let back = x.cast(F32).into_data();
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![0.5, -1.25, 3.0]);
    assert_eq!(
        y.cast(F32).into_data().to_vec::<f32>().unwrap(),
        vec![0.5, -1.25, 3.0]
    );
}

const ON_BF16: Fp16 = Fp16::On(Precision::Bf16);

#[test]
fn bf16_auto_fp16_casts_every_argument() {
    let on = Table::new(ON_BF16).auto_all(tensor(F32), tensor(F32));
    assert_eq!(dtypes2(on), [BF16, BF16]);
}

#[test]
fn bf16_auto_fp16_apply_to_x_casts_only_x() {
    let on = Table::new(ON_BF16).auto_x(tensor(F32), tensor(F32));
    assert_eq!(dtypes2(on), [BF16, F32]);
}

#[test]
fn bf16_auto_fp16_out_fp32_casts_the_output_back() {
    let on = Table::new(ON_BF16).auto_xy_out(tensor(BF16), tensor(F32), tensor(F32));
    assert_eq!(dtypes3(on), [F32, F32, F32]);
}

/// Two half types exist: `force_fp32` guarantees fp32 for either, and `auto_fp16` gives the
/// model's own half type for fp32 and for the other half type. Every combination, every
/// element type, both directions of the output cast.
#[test]
fn every_combination_of_model_precision_and_input_dtype() {
    let models = [(Precision::F16, F16), (Precision::Bf16, BF16)];
    for (precision, half) in models {
        let model = Table::new(Fp16::On(precision));
        for input in [F32, F16, BF16] {
            let (x, _) = model.auto_all(tensor(input), tensor(input));
            assert_eq!(
                x.dtype(),
                half,
                "auto_fp16, {precision} model, {input:?} in"
            );
            let (x, _) = model.force_all(tensor(input), tensor(input));
            assert_eq!(
                x.dtype(),
                F32,
                "force_fp32, {precision} model, {input:?} in"
            );
            // out_fp32 / out_fp16 on the first output, which the body passes through.
            let (x, _, _) = model.auto_xy_out(tensor(input), tensor(F32), tensor(F32));
            assert_eq!(x.dtype(), F32, "auto_fp16 out_fp32, {precision}, {input:?}");
            let (x, _, _) = model.force_xy_out(tensor(input), tensor(F32), tensor(F32));
            assert_eq!(
                x.dtype(),
                half,
                "force_fp32 out_fp16, {precision}, {input:?}"
            );
            // Values that every type holds exactly survive.
            assert_eq!(
                x.cast(F32).into_data().to_vec::<f32>().unwrap(),
                vec![0.5, -1.25, 3.0]
            );
        }
        // Off: nothing moves, whatever comes in.
        for input in [F32, F16, BF16] {
            let (x, _) = Table::new(Fp16::Off).auto_all(tensor(input), tensor(input));
            assert_eq!(x.dtype(), input);
            let (x, _) = Table::new(Fp16::Off).force_all(tensor(input), tensor(input));
            assert_eq!(x.dtype(), input);
        }
    }
}

#[test]
fn non_float_and_wide_tensors_pass_unchanged_in_either_direction() {
    let device = Default::default();
    for precision in [Precision::F16, Precision::Bf16] {
        let on = Fp16::On(precision);
        let labels = Tensor::<B, 1, Int>::from_ints([1, 2, 3], &device);
        let mask = Tensor::<B, 1, Bool>::from_bool(
            burn::tensor::TensorData::from([true, false, true]),
            &device,
        );
        let wide = tensor(F32).cast(DType::F64);
        let bool_dtype = mask.dtype();
        let (labels, mask, wide) = on.to_half((labels, mask, wide));
        assert_eq!(labels.dtype(), DType::I32);
        assert_eq!(mask.dtype(), bool_dtype);
        assert_eq!(wide.dtype(), DType::F64);
        let (labels, mask, wide) = on.to_fp32((labels, mask, wide));
        assert_eq!(labels.dtype(), DType::I32);
        assert_eq!(mask.dtype(), bool_dtype);
        assert_eq!(wide.dtype(), DType::F64);
    }
}
