//! The forwards of [`Fp32`] islands around the layers of `burn::nn`: Burn's signatures, run in
//! fp32 (see [`Fp32`] for the casting rule).

use burn::nn;
use burn::nn::attention::MhaOutput;
use burn::tensor::{Bool, Int, Tensor};

use super::island::{dtype_of, enter, leave};
use super::Fp32;
use crate::cast::CastFloat;

/// Layers whose forward maps one float tensor of any rank to one of the same rank (with or
/// without parameters).
macro_rules! rank_generic {
    ($($ty:ident)::+) => {
        impl Fp32<$($ty)::+> {
            /// Burn's forward, in fp32: the input cast to fp32, the output cast back.
            pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
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

rank_generic!(nn::LocalResponseNorm);
rank_generic!(nn::Softplus);
rank_generic!(nn::Relu);
rank_generic!(nn::Gelu);
rank_generic!(nn::Sigmoid);
rank_generic!(nn::Tanh);
rank_generic!(nn::LeakyRelu);
rank_generic!(nn::HardSigmoid);
rank_generic!(nn::activation::HardSwish);
rank_generic!(nn::Celu);
rank_generic!(nn::Elu);
rank_generic!(nn::Selu);
rank_generic!(nn::GLU);
rank_generic!(nn::Softsign);
rank_generic!(nn::ThresholdedRelu);
rank_generic!(nn::HardShrink);
rank_generic!(nn::SoftShrink);
rank_generic!(nn::Shrink);
rank_generic!(nn::Dropout);
rank_generic!(nn::GaussianNoise);

/// Layers with a fixed input rank.
macro_rules! fixed_rank {
    ($($ty:ident)::+, $d:literal -> $e:literal) => {
        impl Fp32<$($ty)::+> {
            /// Burn's forward, in fp32: the input cast to fp32, the output cast back.
            pub fn forward(&self, input: Tensor<$d>) -> Tensor<$e> {
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

/// Layers comparing two inputs, row by row.
macro_rules! pairwise {
    ($($ty:ident)::+) => {
        impl Fp32<$($ty)::+> {
            /// Burn's forward, in fp32: both inputs cast to fp32, the output cast back.
            pub fn forward(&self, x1: Tensor<2>, x2: Tensor<2>) -> Tensor<1> {
                let out = self.output_dtype([dtype_of(&x1)]);
                let (x1, x2) = enter((x1, x2));
                leave(self.inner().forward(x1, x2), out)
            }
        }
    };
}

pairwise!(nn::CosineSimilarity);
pairwise!(nn::PairwiseDistance);

impl Fp32<nn::Embedding> {
    /// Burn's forward, in fp32: the embeddings come out in the model's half type.
    pub fn forward(&self, input: Tensor<2, Int>) -> Tensor<3> {
        let out = self.output_dtype([]);
        leave(self.inner().forward(input), out)
    }
}

impl Fp32<nn::conv::DeformConv2d> {
    /// Burn's forward, in fp32: input, offset and mask cast to fp32, the output cast back.
    pub fn forward(
        &self,
        input: Tensor<4>,
        offset: Tensor<4>,
        mask: Option<Tensor<4>>,
    ) -> Tensor<4> {
        let out = self.output_dtype([dtype_of(&input)]);
        let (input, offset, mask) = enter((input, offset, mask));
        leave(self.inner().forward(input, offset, mask), out)
    }
}

/// Recurrent layers: the input and the state cast to fp32, the output and the state cast back.
macro_rules! recurrent {
    ($ty:ident, $state:ty, $output:ty) => {
        impl Fp32<nn::$ty> {
            /// Burn's forward, in fp32: input and state cast to fp32, outputs cast back.
            pub fn forward(&self, batched_input: Tensor<3>, state: Option<$state>) -> $output {
                let out = self.output_dtype([dtype_of(&batched_input)]);
                let (input, state) = enter((batched_input, state));
                leave(self.inner().forward(input, state), out)
            }
        }
    };
}

recurrent!(Lstm, nn::LstmState<2>, (Tensor<3>, nn::LstmState<2>));
recurrent!(BiLstm, nn::LstmState<3>, (Tensor<3>, nn::LstmState<3>));
recurrent!(Rnn, nn::RnnState<2>, (Tensor<3>, nn::RnnState<2>));
recurrent!(BiRnn, nn::RnnState<3>, (Tensor<3>, nn::RnnState<3>));
recurrent!(Gru, Tensor<2>, Tensor<3>);
recurrent!(BiGru, Tensor<3>, (Tensor<3>, Tensor<3>));

impl Fp32<nn::attention::CrossAttention> {
    /// Burn's forward, in fp32: query and context cast to fp32, the output cast back.
    pub fn forward(
        &self,
        query: Tensor<3>,
        context: Tensor<3>,
        mask: Option<Tensor<2, Bool>>,
    ) -> Tensor<3> {
        let out = self.output_dtype([dtype_of(&query)]);
        let (query, context) = enter((query, context));
        leave(self.inner().forward(query, context, mask), out)
    }
}

impl Fp32<nn::attention::MultiHeadAttention> {
    /// Burn's forward, in fp32, on memsave's [`MhaInput`] (Burn's keeps its tensors private):
    /// query, key and value cast to fp32, context and weights cast back.
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        let out = self.output_dtype([dtype_of(&input.query)]);
        let output = self.inner().forward(enter(input).into_burn());
        MhaOutput {
            weights: leave(output.weights, out),
            context: leave(output.context, out),
        }
    }
}

impl Fp32<nn::transformer::TransformerEncoder> {
    /// Burn's forward, in fp32, on memsave's [`TransformerEncoderInput`] (Burn's keeps its
    /// tensors private): the input cast to fp32, the output cast back.
    pub fn forward(&self, input: TransformerEncoderInput) -> Tensor<3> {
        let out = self.output_dtype([dtype_of(&input.tensor)]);
        leave(self.inner().forward(enter(input).into_burn()), out)
    }
}

impl Fp32<nn::transformer::TransformerEncoderLayer> {
    /// Burn's forward, in fp32: the input cast to fp32, the output cast back.
    pub fn forward(
        &self,
        input: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        let out = self.output_dtype([dtype_of(&input)]);
        leave(self.inner().forward(enter(input), mask_pad, mask_attn), out)
    }
}

impl Fp32<nn::transformer::TransformerDecoder> {
    /// Burn's forward, in fp32, on memsave's [`TransformerDecoderInput`] (Burn's keeps its
    /// tensors private): target and memory cast to fp32, the output cast back.
    pub fn forward(&self, input: TransformerDecoderInput) -> Tensor<3> {
        let out = self.output_dtype([dtype_of(&input.target)]);
        leave(self.inner().forward(enter(input).into_burn()), out)
    }
}

/// The input of an fp32 island around Burn's `MultiHeadAttention`: Burn's `MhaInput`, with its
/// tensors reachable so that the island can cast them. Built the same way.
#[derive(Clone, Debug)]
pub struct MhaInput {
    /// `[batch_size, seq_length_1, d_model]`
    pub query: Tensor<3>,
    /// `[batch_size, seq_length_2, d_model]`
    pub key: Tensor<3>,
    /// `[batch_size, seq_length_2, d_model]`
    pub value: Tensor<3>,
    /// `[batch_size, seq_length_2]`, true where padded.
    pub mask_pad: Option<Tensor<2, Bool>>,
    /// `[batch_size, seq_length_1, seq_length_2]`, true where masked.
    pub mask_attn: Option<Tensor<3, Bool>>,
}

impl MhaInput {
    /// Self-attention: query, key and value are `tensor`.
    pub fn self_attn(tensor: Tensor<3>) -> Self {
        Self::new(tensor.clone(), tensor.clone(), tensor)
    }

    /// Attention of `query` over `key` and `value`.
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        MhaInput {
            query,
            key,
            value,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// With a padding mask.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// With an attention mask.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Burn's input.
    pub fn into_burn(self) -> nn::attention::MhaInput {
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

impl From<MhaInput> for nn::attention::MhaInput {
    fn from(input: MhaInput) -> Self {
        input.into_burn()
    }
}

impl CastFloat for MhaInput {
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
pub struct TransformerEncoderInput {
    /// `[batch_size, seq_length, d_model]`
    pub tensor: Tensor<3>,
    /// `[batch_size, seq_length]`, true where padded.
    pub mask_pad: Option<Tensor<2, Bool>>,
    /// `[batch_size, seq_length, seq_length]`, true where masked.
    pub mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerEncoderInput {
    /// The input sequence.
    pub fn new(tensor: Tensor<3>) -> Self {
        TransformerEncoderInput {
            tensor,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// With a padding mask.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// With an attention mask.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Burn's input.
    pub fn into_burn(self) -> nn::transformer::TransformerEncoderInput {
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

impl CastFloat for TransformerEncoderInput {
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
pub struct TransformerDecoderInput {
    /// `[batch_size, target_length, d_model]`
    pub target: Tensor<3>,
    /// `[batch_size, target_length]`, true where padded.
    pub target_mask_pad: Option<Tensor<2, Bool>>,
    /// `[batch_size, target_length, target_length]`, true where masked.
    pub target_mask_attn: Option<Tensor<3, Bool>>,
    /// `[batch_size, memory_length, d_model]`
    pub memory: Tensor<3>,
    /// `[batch_size, memory_length]`, true where padded.
    pub memory_mask_pad: Option<Tensor<2, Bool>>,
    /// `[batch_size, target_length, memory_length]`, true where masked.
    pub memory_mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerDecoderInput {
    /// The target sequence and the encoder's memory.
    pub fn new(target: Tensor<3>, memory: Tensor<3>) -> Self {
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
    pub fn memory_mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.memory_mask_pad = Some(mask);
        self
    }

    /// With an attention mask on the memory.
    pub fn memory_mask_attn(mut self, mask: Tensor<3, Bool>) -> Self {
        self.memory_mask_attn = Some(mask);
        self
    }

    /// With a padding mask on the target.
    pub fn target_mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.target_mask_pad = Some(mask);
        self
    }

    /// With an attention mask on the target.
    pub fn target_mask_attn(mut self, mask: Tensor<3, Bool>) -> Self {
        self.target_mask_attn = Some(mask);
        self
    }

    /// Burn's input.
    pub fn into_burn(self) -> nn::transformer::TransformerDecoderInput {
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

impl CastFloat for TransformerDecoderInput {
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
impl<const D: usize> CastFloat for nn::LstmState<D> {
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

impl<const D: usize> CastFloat for nn::RnnState<D> {
    fn cast_float(self, from: burn::tensor::DType, to: burn::tensor::DType) -> Self {
        nn::RnnState::new(self.hidden.cast_float(from, to))
    }

    fn visit_float_dtypes(&self, f: &mut dyn FnMut(burn::tensor::DType)) {
        f(self.hidden.dtype());
    }
}

impl CastFloat for MhaOutput {
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
