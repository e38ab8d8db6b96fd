//! The weight gradient of a linear layer on Flex, added in place into the gradient the weight
//! already has (the group's sums under accumulation), as the convolution's is.

use burn::tensor::{DType, Shape, TensorData};
use burn_flex::FlexTensor;
use gemm::{gemm, Parallelism};

use super::conv::contiguous;

/// `dW = x^T * dy` of `y = x * W` (a linear layer): x `[N, in]`, dy `[N, out]`, fp32, into
/// `onto` in place (`+=`) when it fits as in [`super::conv::weight_grad_onto`], else into a new buffer
/// (`Err`, with `onto` handed back). x and dy must be fp32.
pub(crate) fn linear_weight_grad_onto(
    x: &FlexTensor,
    dy: &FlexTensor,
    onto: Option<FlexTensor>,
) -> Result<FlexTensor, (FlexTensor, Option<FlexTensor>)> {
    assert!(
        x.dtype() == DType::F32 && dy.dtype() == DType::F32,
        "linear weight gradient: fp32 only"
    );
    let (x, dy) = (contiguous(x), contiguous(dy));
    let (xd, yd) = (x.layout().shape().to_vec(), dy.layout().shape().to_vec());
    let (rows, input, output) = (xd[0], xd[1], yd[1]);
    let xs = x.as_slice::<f32>().expect("contiguous f32");
    let dys = dy.as_slice::<f32>().expect("contiguous f32");
    let product = |dw: &mut [f32], add: bool| {
        assert_eq!(
            dw.len(),
            input * output,
            "linear weight gradient: buffer of another size"
        );
        // dst (in x out) (+)= lhs (in x rows) * rhs (rows x out), lhs[i, r] = x[r, i].
        // SAFETY: dst covers in*out elements, lhs rows*in, rhs rows*out; none overlaps dst.
        unsafe {
            gemm(
                input,
                output,
                rows,
                dw.as_mut_ptr(),
                1,
                output as isize,
                add,
                xs.as_ptr(),
                input as isize,
                1,
                dys.as_ptr(),
                1,
                output as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                Parallelism::Rayon(0),
            );
        }
    };
    let fits = |t: &FlexTensor| {
        t.dtype() == DType::F32
            && t.layout().shape().to_vec() == vec![input, output]
            && t.is_contiguous()
            && t.layout().start_offset() == 0
            && t.is_unique()
    };
    match onto {
        Some(mut sum) if fits(&sum) => {
            product(sum.try_storage_mut::<f32>().expect("checked: unique"), true);
            Ok(sum)
        }
        onto => {
            let mut dw = vec![0.0f32; input * output];
            product(&mut dw, false);
            let dw = FlexTensor::from_data(TensorData::new(dw, Shape::from(vec![input, output])));
            Err((dw, onto))
        }
    }
}
