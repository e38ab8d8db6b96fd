//! The forwards of [`Fp32`] islands around the layers of `burn::nn`: Burn's signatures, run in
//! fp32 (see [`Fp32`] for the casting rule).

use burn::nn;
use burn::nn::attention::MhaOutput;
use burn::prelude::Backend;
use burn::tensor::{Bool, Int, Tensor};

use super::island::{dtype_of, enter, leave};
use super::Fp32;
use crate::cast::CastFloat;

/// Layers whose forward maps one float tensor of any rank to one of the same rank.
macro_rules! rank_generic {
    ($($ty:ident)::+) => {
        impl<B: Backend> Fp32<$($ty)::+<B>> {
            /// Burn's forward, in fp32: the input cast to fp32, the output cast back.
            pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
                let out = self.output_dtype([dtype_of(&input)]);
                leave(self.inner().forward(enter(input)), out)
            }
        }
    };
}

rank_generic!(nn::LayerNorm);
rank_generic!(nn::RmsNorm);
rank_generic!(nn::InstanceNorm);
rank_generic!(nn::BatchNorm);
rank_generic!(nn::GroupNorm);
rank_generic!(nn::norm::Normalization);
rank_generic!(nn::Linear);
rank_generic!(nn::PRelu);
rank_generic!(nn::SwiGlu);
rank_generic!(nn::activation::Activation);
rank_generic!(nn::RotaryEncoding);
rank_generic!(nn::transformer::PositionWiseFeedForward);

/// Layers without parameters (generic over the backend in their forward).
macro_rules! parameter_free {
    ($($ty:ident)::+) => {
        impl Fp32<$($ty)::+> {
            /// Burn's forward, in fp32: the input cast to fp32, the output cast back.
            pub fn forward<B: Backend, const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
                let out = self.output_dtype([dtype_of(&input)]);
                leave(self.inner().forward(enter(input)), out)
            }
        }
    };
}

parameter_free!(nn::LocalResponseNorm);
parameter_free!(nn::Softplus);
parameter_free!(nn::Relu);
parameter_free!(nn::Gelu);
parameter_free!(nn::Sigmoid);
parameter_free!(nn::Tanh);
parameter_free!(nn::LeakyRelu);
parameter_free!(nn::HardSigmoid);
parameter_free!(nn::activation::HardSwish);
parameter_free!(nn::Celu);
parameter_free!(nn::Elu);
parameter_free!(nn::Selu);
parameter_free!(nn::GLU);
parameter_free!(nn::Softsign);
parameter_free!(nn::ThresholdedRelu);
parameter_free!(nn::HardShrink);
parameter_free!(nn::SoftShrink);
parameter_free!(nn::Shrink);
parameter_free!(nn::Dropout);
parameter_free!(nn::GaussianNoise);

/// Layers with a fixed input rank.
macro_rules! fixed_rank {
    ($($ty:ident)::+, $d:literal -> $e:literal) => {
        impl<B: Backend> Fp32<$($ty)::+<B>> {
            /// Burn's forward, in fp32: the input cast to fp32, the output cast back.
            pub fn forward(&self, input: Tensor<B, $d>) -> Tensor<B, $e> {
                let out = self.output_dtype([dtype_of(&input)]);
                leave(self.inner().forward(enter(input)), out)
            }
        }
    };
}

fixed_rank!(nn::conv::Conv1d, 3 -> 3);
fixed_rank!(nn::conv::Conv2d, 4 -> 4);
fixed_rank!(nn::conv::Conv3d, 5 -> 5);
fixed_rank!(nn::conv::ConvTranspose1d, 3 -> 3);
fixed_rank!(nn::conv::ConvTranspose2d, 4 -> 4);
fixed_rank!(nn::conv::ConvTranspose3d, 5 -> 5);
fixed_rank!(nn::PositionalEncoding, 3 -> 3);

impl<B: Backend> Fp32<nn::Embedding<B>> {
    /// Burn's forward, in fp32: the embeddings come out in the model's half type.
    pub fn forward(&self, input: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let out = self.output_dtype([]);
        leave(self.inner().forward(input), out)
    }
}

impl<B: Backend> Fp32<nn::conv::DeformConv2d<B>> {
    /// Burn's forward, in fp32: input, offset and mask cast to fp32, the output cast back.
    pub fn forward(
        &self,
        input: Tensor<B, 4>,
        offset: Tensor<B, 4>,
        mask: Option<Tensor<B, 4>>,
    ) -> Tensor<B, 4> {
        let out = self.output_dtype([dtype_of(&input)]);
        let (input, offset, mask) = enter((input, offset, mask));
        leave(self.inner().forward(input, offset, mask), out)
    }
}

/// Recurrent layers: the input and the state cast to fp32, the output and the state cast back.
macro_rules! recurrent {
    ($ty:ident, $state:ty, $output:ty) => {
        impl<B: Backend> Fp32<nn::$ty<B>> {
            /// Burn's forward, in fp32: input and state cast to fp32, outputs cast back.
            pub fn forward(&self, batched_input: Tensor<B, 3>, state: Option<$state>) -> $output {
                let out = self.output_dtype([dtype_of(&batched_input)]);
                let (input, state) = enter((batched_input, state));
                leave(self.inner().forward(input, state), out)
            }
        }
    };
}

recurrent!(Lstm, nn::LstmState<B, 2>, (Tensor<B, 3>, nn::LstmState<B, 2>));
recurrent!(BiLstm, nn::LstmState<B, 3>, (Tensor<B, 3>, nn::LstmState<B, 3>));
recurrent!(Rnn, nn::RnnState<B, 2>, (Tensor<B, 3>, nn::RnnState<B, 2>));
recurrent!(BiRnn, nn::RnnState<B, 3>, (Tensor<B, 3>, nn::RnnState<B, 3>));
recurrent!(Gru, Tensor<B, 2>, Tensor<B, 3>);
recurrent!(BiGru, Tensor<B, 3>, (Tensor<B, 3>, Tensor<B, 3>));

impl<B: Backend> Fp32<nn::attention::CrossAttention<B>> {
    /// Burn's forward, in fp32: query and context cast to fp32, the output cast back.
    pub fn forward(
        &self,
        query: Tensor<B, 3>,
        context: Tensor<B, 3>,
        mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        let out = self.output_dtype([dtype_of(&query)]);
        let (query, context) = enter((query, context));
        leave(self.inner().forward(query, context, mask), out)
    }
}

impl<B: Backend> Fp32<nn::attention::MultiHeadAttention<B>> {
    /// Burn's forward, in fp32, on memsave's [`MhaInput`] (Burn's keeps its tensors private):
    /// query, key and value cast to fp32, context and weights cast back.
    pub fn forward(&self, input: MhaInput<B>) -> MhaOutput<B> {
        let out = self.output_dtype([dtype_of(&input.query)]);
        let output = self.inner().forward(enter(input).into_burn());
        MhaOutput {
            weights: leave(output.weights, out),
            context: leave(output.context, out),
        }
    }
}

impl<B: Backend> Fp32<nn::transformer::TransformerEncoder<B>> {
    /// Burn's forward, in fp32, on memsave's [`TransformerEncoderInput`] (Burn's keeps its
    /// tensors private): the input cast to fp32, the output cast back.
    pub fn forward(&self, input: TransformerEncoderInput<B>) -> Tensor<B, 3> {
        let out = self.output_dtype([dtype_of(&input.tensor)]);
        leave(self.inner().forward(enter(input).into_burn()), out)
    }
}

impl<B: Backend> Fp32<nn::transformer::TransformerEncoderLayer<B>> {
    /// Burn's forward, in fp32: the input cast to fp32, the output cast back.
    pub fn forward(
        &self,
        input: Tensor<B, 3>,
        mask_pad: Option<Tensor<B, 2, Bool>>,
        mask_attn: Option<Tensor<B, 3, Bool>>,
    ) -> Tensor<B, 3> {
        let out = self.output_dtype([dtype_of(&input)]);
        leave(self.inner().forward(enter(input), mask_pad, mask_attn), out)
    }
}

impl<B: Backend> Fp32<nn::transformer::TransformerDecoder<B>> {
    /// Burn's forward, in fp32, on memsave's [`TransformerDecoderInput`] (Burn's keeps its
    /// tensors private): target and memory cast to fp32, the output cast back.
    pub fn forward(&self, input: TransformerDecoderInput<B>) -> Tensor<B, 3> {
        let out = self.output_dtype([dtype_of(&input.target)]);
        leave(self.inner().forward(enter(input).into_burn()), out)
    }
}

/// The input of an fp32 island around Burn's `MultiHeadAttention`: Burn's `MhaInput`, with its
/// tensors reachable so that the island can cast them. Built the same way.
#[derive(Clone, Debug)]
pub struct MhaInput<B: Backend> {
    /// `[batch_size, seq_length_1, d_model]`
    pub query: Tensor<B, 3>,
    /// `[batch_size, seq_length_2, d_model]`
    pub key: Tensor<B, 3>,
    /// `[batch_size, seq_length_2, d_model]`
    pub value: Tensor<B, 3>,
    /// `[batch_size, seq_length_2]`, true where padded.
    pub mask_pad: Option<Tensor<B, 2, Bool>>,
    /// `[batch_size, seq_length_1, seq_length_2]`, true where masked.
    pub mask_attn: Option<Tensor<B, 3, Bool>>,
}

impl<B: Backend> MhaInput<B> {
    /// Self-attention: query, key and value are `tensor`.
    pub fn self_attn(tensor: Tensor<B, 3>) -> Self {
        Self::new(tensor.clone(), tensor.clone(), tensor)
    }

    /// Attention of `query` over `key` and `value`.
    pub fn new(query: Tensor<B, 3>, key: Tensor<B, 3>, value: Tensor<B, 3>) -> Self {
        MhaInput {
            query,
            key,
            value,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// With a padding mask.
    pub fn mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// With an attention mask.
    pub fn mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Burn's input.
    pub fn into_burn(self) -> nn::attention::MhaInput<B> {
        let mut input = nn::attention::MhaInput::new(self.query, self.key, self.value);
        if let Some(mask) = self.mask_pad {
            input = input.mask_pad(mask);
        }
        if let Some(mask) = self.mask_attn {
            input = input.mask_attn(mask);
        }
        input
    }
}

impl<B: Backend> From<MhaInput<B>> for nn::attention::MhaInput<B> {
    fn from(input: MhaInput<B>) -> Self {
        input.into_burn()
    }
}

impl<B: Backend> CastFloat for MhaInput<B> {
    fn cast_float(self, from: burn::tensor::DType, to: burn::tensor::DType) -> Self {
        let (query, key, value) = (self.query, self.key, self.value).cast_float(from, to);
        MhaInput {
            query,
            key,
            value,
            ..self
        }
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(burn::tensor::DType)) {
        f(self.query.dtype());
        f(self.key.dtype());
        f(self.value.dtype());
    }
}

/// The input of an fp32 island around Burn's `TransformerEncoder`, with its tensors reachable.
#[derive(Clone, Debug)]
pub struct TransformerEncoderInput<B: Backend> {
    /// `[batch_size, seq_length, d_model]`
    pub tensor: Tensor<B, 3>,
    /// `[batch_size, seq_length]`, true where padded.
    pub mask_pad: Option<Tensor<B, 2, Bool>>,
    /// `[batch_size, seq_length, seq_length]`, true where masked.
    pub mask_attn: Option<Tensor<B, 3, Bool>>,
}

impl<B: Backend> TransformerEncoderInput<B> {
    /// The input sequence.
    pub fn new(tensor: Tensor<B, 3>) -> Self {
        TransformerEncoderInput {
            tensor,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// With a padding mask.
    pub fn mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// With an attention mask.
    pub fn mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Burn's input.
    pub fn into_burn(self) -> nn::transformer::TransformerEncoderInput<B> {
        let mut input = nn::transformer::TransformerEncoderInput::new(self.tensor);
        if let Some(mask) = self.mask_pad {
            input = input.mask_pad(mask);
        }
        if let Some(mask) = self.mask_attn {
            input = input.mask_attn(mask);
        }
        input
    }
}

impl<B: Backend> CastFloat for TransformerEncoderInput<B> {
    fn cast_float(self, from: burn::tensor::DType, to: burn::tensor::DType) -> Self {
        TransformerEncoderInput {
            tensor: self.tensor.cast_float(from, to),
            ..self
        }
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(burn::tensor::DType)) {
        f(self.tensor.dtype());
    }
}

/// The input of an fp32 island around Burn's `TransformerDecoder`, with its tensors reachable.
#[derive(Clone, Debug)]
pub struct TransformerDecoderInput<B: Backend> {
    /// `[batch_size, target_length, d_model]`
    pub target: Tensor<B, 3>,
    /// `[batch_size, target_length]`, true where padded.
    pub target_mask_pad: Option<Tensor<B, 2, Bool>>,
    /// `[batch_size, target_length, target_length]`, true where masked.
    pub target_mask_attn: Option<Tensor<B, 3, Bool>>,
    /// `[batch_size, memory_length, d_model]`
    pub memory: Tensor<B, 3>,
    /// `[batch_size, memory_length]`, true where padded.
    pub memory_mask_pad: Option<Tensor<B, 2, Bool>>,
    /// `[batch_size, target_length, memory_length]`, true where masked.
    pub memory_mask_attn: Option<Tensor<B, 3, Bool>>,
}

impl<B: Backend> TransformerDecoderInput<B> {
    /// The target sequence and the encoder's memory.
    pub fn new(target: Tensor<B, 3>, memory: Tensor<B, 3>) -> Self {
        TransformerDecoderInput {
            target,
            target_mask_pad: None,
            target_mask_attn: None,
            memory,
            memory_mask_pad: None,
            memory_mask_attn: None,
        }
    }

    /// With a padding mask on the memory.
    pub fn memory_mask_pad(mut self, mask: Tensor<B, 2, Bool>) -> Self {
        self.memory_mask_pad = Some(mask);
        self
    }

    /// With an attention mask on the memory.
    pub fn memory_mask_attn(mut self, mask: Tensor<B, 3, Bool>) -> Self {
        self.memory_mask_attn = Some(mask);
        self
    }

    /// With a padding mask on the target.
    pub fn target_mask_pad(mut self, mask: Tensor<B, 2, Bool>) -> Self {
        self.target_mask_pad = Some(mask);
        self
    }

    /// With an attention mask on the target.
    pub fn target_mask_attn(mut self, mask: Tensor<B, 3, Bool>) -> Self {
        self.target_mask_attn = Some(mask);
        self
    }

    /// Burn's input.
    pub fn into_burn(self) -> nn::transformer::TransformerDecoderInput<B> {
        let mut input = nn::transformer::TransformerDecoderInput::new(self.target, self.memory);
        if let Some(mask) = self.target_mask_pad {
            input = input.target_mask_pad(mask);
        }
        if let Some(mask) = self.target_mask_attn {
            input = input.target_mask_attn(mask);
        }
        if let Some(mask) = self.memory_mask_pad {
            input = input.memory_mask_pad(mask);
        }
        if let Some(mask) = self.memory_mask_attn {
            input = input.memory_mask_attn(mask);
        }
        input
    }
}

impl<B: Backend> CastFloat for TransformerDecoderInput<B> {
    fn cast_float(self, from: burn::tensor::DType, to: burn::tensor::DType) -> Self {
        let (target, memory) = (self.target, self.memory).cast_float(from, to);
        TransformerDecoderInput {
            target,
            memory,
            ..self
        }
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(burn::tensor::DType)) {
        f(self.target.dtype());
        f(self.memory.dtype());
    }
}

/// The recurrent states cross islands (and `#[auto_fp16]` methods) with their tensors cast.
impl<B: Backend, const D: usize> CastFloat for nn::LstmState<B, D> {
    fn cast_float(self, from: burn::tensor::DType, to: burn::tensor::DType) -> Self {
        nn::LstmState::new(
            self.cell.cast_float(from, to),
            self.hidden.cast_float(from, to),
        )
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(burn::tensor::DType)) {
        f(self.cell.dtype());
        f(self.hidden.dtype());
    }
}

impl<B: Backend, const D: usize> CastFloat for nn::RnnState<B, D> {
    fn cast_float(self, from: burn::tensor::DType, to: burn::tensor::DType) -> Self {
        nn::RnnState::new(self.hidden.cast_float(from, to))
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(burn::tensor::DType)) {
        f(self.hidden.dtype());
    }
}

impl<B: Backend> CastFloat for MhaOutput<B> {
    fn cast_float(self, from: burn::tensor::DType, to: burn::tensor::DType) -> Self {
        MhaOutput {
            weights: self.weights.cast_float(from, to),
            context: self.context.cast_float(from, to),
        }
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(burn::tensor::DType)) {
        f(self.context.dtype());
        f(self.weights.dtype());
    }
}
