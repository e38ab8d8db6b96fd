//! fp32 islands: a layer kept in fp32 inside a half-precision model, its inputs cast to fp32
//! and its outputs cast back (what MMCV's `patch_norm_fp32` does to its norms, for any layer).

use crate::fp16::PrecisionExt;
use burn::module::{
    Content, Devices, DisplaySettings, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor,
};
use burn::tensor::{DType, Device, Tensor};

use super::{Fp16Module, Precision};
use crate::cast::{cast_tensor_type, CastFloat};

/// A layer that stays fp32 in a half-precision model: an *fp32 island*.
///
/// `wrap_fp16_model` leaves its parameters fp32 and tells it the model's half type. Its
/// forward casts every half input to fp32, runs the layer in fp32, and casts the outputs to
/// the half type its inputs came in (fp32 inputs give fp32 outputs; a layer fed only token ids,
/// an `Embedding`, gives the model's half type). In an fp32 model it is the layer itself.
///
/// Written `#[fp16(fp32)] norm: LayerNorm` in a `#[memsave::model]` struct, the field's
/// type becomes `Fp32<LayerNorm>`; build it with `.into()`
/// (`norm: LayerNormConfig::new(64).init(device).into()`). Every layer of `burn::nn` gets its
/// own forward with Burn's signature, so `self.norm.forward(x)` reads as before; any other
/// module runs through [`Fp32::run`]. Its record is the layer's record: a checkpoint saved
/// without the island loads into it, and back.
///
/// Burn's `MultiHeadAttention` and `TransformerEncoder`/`Decoder` take inputs whose tensors
/// Burn keeps private, so an island cannot cast them: their island forwards take memsave's
/// [`MhaInput`](super::MhaInput), [`TransformerEncoderInput`](super::TransformerEncoderInput)
/// and [`TransformerDecoderInput`](super::TransformerDecoderInput), built the same way.
#[derive(Clone, Debug)]
pub struct Fp32<M> {
    inner: M,
    /// The model's half type, once wrapped.
    half: Option<Precision>,
}

impl<M> Fp32<M> {
    /// The layer as an island.
    pub fn new(inner: M) -> Self {
        Fp32 { inner, half: None }
    }

    /// The layer.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The layer, mutably.
    pub fn inner_mut(&mut self) -> &mut M {
        &mut self.inner
    }

    /// The layer, out of its island.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The half type of the model around the island, once `wrap_fp16_model` has run.
    pub fn precision(&self) -> Option<Precision> {
        self.half
    }

    /// Runs `f` on the layer in fp32: every half float tensor of `input` cast to fp32, every
    /// fp32 tensor of the output cast to the half type of the inputs (see [`Fp32`]).
    ///
    /// ```
    /// # use burn::nn::LinearConfig;
    /// # use burn::tensor::{DType, Tensor};
    /// # use memsave_next::fp16::{Fp32, Fp16Module, Precision};
    /// let device = Default::default();
    /// let island: Fp32<_> = LinearConfig::new(4, 2).init(&device).into();
    /// let island = island.wrap_fp16(Precision::F16);
    /// let x = Tensor::<2>::ones([3, 4], &device).cast(DType::F16);
    /// let y = island.run(x, |linear, x| linear.forward(x));
    /// assert_eq!(y.dtype(), DType::F16);
    /// ```
    pub fn run<I: CastFloat, O: CastFloat>(&self, input: I, f: impl FnOnce(&M, I) -> O) -> O {
        let mut dtypes = Vec::new();
        input.visit_float_dtypes(&mut |dtype| dtypes.push(dtype));
        let out = self.output_dtype(dtypes);
        let output = f(&self.inner, enter(input));
        leave(output, out)
    }

    /// The dtype outputs are cast to: the first half dtype among the inputs; none (fp32) if
    /// they are fp32; the model's half type if no float tensor came in.
    pub(super) fn output_dtype(&self, inputs: impl IntoIterator<Item = DType>) -> Option<DType> {
        let mut any_float = false;
        for dtype in inputs {
            match dtype {
                DType::F16 | DType::BF16 => return Some(dtype),
                dtype if dtype.is_float() => any_float = true,
                _ => {}
            }
        }
        if any_float {
            None
        } else {
            self.half.map(PrecisionExt::dtype)
        }
    }
}

/// Half float tensors to fp32.
pub(super) fn enter<T: CastFloat>(value: T) -> T {
    let value = cast_tensor_type(value, DType::F16, DType::F32);
    cast_tensor_type(value, DType::BF16, DType::F32)
}

/// fp32 float tensors to `dtype`, if any.
pub(super) fn leave<T: CastFloat>(value: T, dtype: Option<DType>) -> T {
    match dtype {
        Some(dtype) => cast_tensor_type(value, DType::F32, dtype),
        None => value,
    }
}

/// The dtype of a float tensor, as an input of [`Fp32::output_dtype`].
pub(super) fn dtype_of<const D: usize>(tensor: &Tensor<D>) -> DType {
    tensor.dtype()
}

impl<M> From<M> for Fp32<M> {
    fn from(inner: M) -> Self {
        Fp32::new(inner)
    }
}

/// The island keeps its parameters fp32 and learns the model's half type.
impl<M> Fp16Module for Fp32<M> {
    fn wrap_fp16(self, precision: Precision) -> Self {
        Fp32 {
            inner: self.inner,
            half: Some(precision),
        }
    }
}

impl<M: crate::checkpoint::CheckpointModule> crate::checkpoint::CheckpointModule for Fp32<M> {
    type Mark = M::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        Fp32 {
            inner: self.inner.set_with_cp(on),
            half: self.half,
        }
    }
}

/// To Burn the island is the layer: same parameters, same paths, same record.
impl<M: Module> Module for Fp32<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.inner.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.with_inner(|inner| inner.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.with_inner(|inner| inner.to_device(device))
    }

    fn train(self) -> Self {
        self.with_inner(Module::train)
    }

    fn valid(&self) -> Self {
        Fp32 {
            inner: self.inner.valid(),
            half: self.half,
        }
    }

    fn materialize(self) -> Self {
        self.with_inner(Module::materialize)
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.inner.visit(visitor)
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        self.with_inner(|inner| inner.map(mapper))
    }
}

impl<M> Fp32<M> {
    /// The island around `f(layer)`.
    fn with_inner(self, f: impl FnOnce(M) -> M) -> Self {
        Fp32 {
            inner: f(self.inner),
            half: self.half,
        }
    }
}

impl<M: ModuleDisplay> ModuleDisplayDefault for Fp32<M> {
    fn content(&self, content: Content) -> Option<Content> {
        self.inner.content(content)
    }

    fn num_params(&self) -> usize {
        ModuleDisplayDefault::num_params(&self.inner)
    }
}

impl<M: ModuleDisplay> ModuleDisplay for Fp32<M> {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        self.inner.custom_settings()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        self.inner.custom_content(content)
    }
}

impl<M: ModuleDisplay> std::fmt::Display for Fp32<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fp32({})", self.inner.format(DisplaySettings::new()))
    }
}
