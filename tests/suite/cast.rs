//! `cast_tensor_type`: MMCV's recursive cast, over tensors, containers and plain values.

use std::collections::{BTreeMap, HashMap};

use burn::backend::Flex;
use burn::prelude::*;
use burn::tensor::DType;
use memsave::cast::cast_tensor_type;

type B = Flex;

fn float(dtype: DType) -> Tensor<B, 2> {
    Tensor::<B, 2>::from_floats([[1.5, -2.0], [0.25, 8.0]], &Default::default()).cast(dtype)
}

#[test]
fn float_to_half_and_back() {
    let half = cast_tensor_type(float(DType::F32), DType::F32, DType::F16);
    assert_eq!(half.dtype(), DType::F16);
    let back = cast_tensor_type(half, DType::F16, DType::F32);
    assert_eq!(back.dtype(), DType::F32);
    assert_eq!(
        back.into_data().to_vec::<f32>().unwrap(),
        vec![1.5, -2.0, 0.25, 8.0]
    );
}

#[test]
fn int_and_bool_tensors_are_untouched() {
    let device = Default::default();
    let labels = Tensor::<B, 1, Int>::from_ints([1, 2, 3], &device);
    let mask = Tensor::<B, 1, Bool>::from_bool(TensorData::from([true, false, true]), &device);
    let (labels, mask) = cast_tensor_type((labels, mask), DType::F32, DType::F16);
    assert_eq!(labels.dtype(), DType::I32);
    assert_eq!(mask.dtype(), DType::Bool(burn::tensor::BoolStore::Native));
    assert_eq!(labels.into_data().to_vec::<i32>().unwrap(), vec![1, 2, 3]);
}

#[test]
fn half_is_untouched_by_a_float_to_half_cast() {
    let bf16 = cast_tensor_type(float(DType::BF16), DType::F32, DType::F16);
    assert_eq!(bf16.dtype(), DType::BF16);
    let f16 = cast_tensor_type(float(DType::F16), DType::F32, DType::F16);
    assert_eq!(f16.dtype(), DType::F16);
}

#[test]
fn nested_containers_are_walked() {
    let value = (
        vec![float(DType::F32), float(DType::F32)],
        Some((float(DType::F32), 7_usize)),
        [float(DType::F32)],
        Box::new(float(DType::F32)),
    );
    let (list, option, array, boxed) = cast_tensor_type(value, DType::F32, DType::F16);
    assert!(list.iter().all(|t| t.dtype() == DType::F16));
    let (inner, count) = option.unwrap();
    assert_eq!(inner.dtype(), DType::F16);
    assert_eq!(count, 7);
    assert_eq!(array[0].dtype(), DType::F16);
    assert_eq!(boxed.dtype(), DType::F16);
}

#[test]
fn maps_cast_values_only() {
    let mut hash = HashMap::new();
    hash.insert("cls".to_string(), float(DType::F32));
    hash.insert("reg".to_string(), float(DType::F16));
    let hash = cast_tensor_type(hash, DType::F32, DType::F16);
    assert_eq!(hash["cls"].dtype(), DType::F16);
    assert_eq!(hash["reg"].dtype(), DType::F16);

    let mut tree = BTreeMap::new();
    tree.insert(3_u32, vec![float(DType::F16)]);
    let tree = cast_tensor_type(tree, DType::F16, DType::F32);
    assert_eq!(tree[&3][0].dtype(), DType::F32);
}

#[test]
fn plain_values_pass_unchanged() {
    let value = (
        3_i64,
        2.5_f64,
        "name",
        String::from("owned"),
        true,
        None::<Tensor<B, 2>>,
    );
    let out = cast_tensor_type(value.clone(), DType::F32, DType::F16);
    assert_eq!(out.0, 3);
    assert_eq!(out.1, 2.5);
    assert_eq!(out.2, "name");
    assert_eq!(out.3, "owned");
    assert!(out.4);
    assert!(out.5.is_none());
}
