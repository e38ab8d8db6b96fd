//! Frozen weights held compressed (`[optimizer] frozen_dtype = "int8"` or `"bf16"`): the
//! weights that do not train (MMDetection's `frozen_stages`, a user's frozen submodule) leave the
//! model, which keeps a placeholder of their shape (one value, broadcast: no memory), and live in
//! the run's table ([`FrozenWeights`]) as int8 per output channel with an fp32 scale each (or as
//! bf16). memsave's layers ([`crate::nn::conv2d`], [`crate::nn::linear`], BatchNorm's fused
//! convolutions) read a weight through [`weight_of`], which dequantizes a frozen one for that
//! layer only, in the forward's type; the copy is gone when the layer is done (a frozen weight
//! needs no gradient).
//!
//! A layer that reads its weight otherwise (Burn's own `forward`) would see the placeholder: the
//! first step ends with an error naming those weights ([`FrozenWeights::unread`]) before
//! anything trains. Snapshots hold the dequantized values ([`expand`]), which quantize to the
//! same codes again on resume.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::prelude::Backend;
use burn::tensor::{DType, Int, IntDType, Tensor, TensorData};

pub use memsave_common::weights::FrozenDtype;

/// One frozen weight as held: `[out, rest]`, with its shape.
#[derive(Clone)]
enum Held<K: Backend> {
    Int8 {
        /// Codes + 127, as u8.
        codes: Tensor<K, 2, Int>,
        /// Per output channel: absmax / 127.
        scales: Tensor<K, 2>,
    },
    Bf16(Tensor<K, 2>),
}

struct Entry {
    shape: Vec<usize>,
    /// The held values (`Held<K>` of the backend they live on).
    held: Box<dyn Any + Send + Sync>,
    /// Reads them.
    reader: Reader,
    /// The held bytes.
    bytes: u64,
    path: String,
}

/// The run's frozen weights (a part of the run's context).
#[derive(Default)]
pub struct FrozenWeights {
    entries: Mutex<HashMap<ParamId, Entry>>,
    read: Mutex<HashSet<ParamId>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl FrozenWeights {
    /// The frozen weights held, their bytes, and the bytes they took in fp32.
    pub fn held(&self) -> (usize, u64, u64) {
        let entries = lock(&self.entries);
        let fp32 = entries
            .values()
            .map(|entry| entry.shape.iter().product::<usize>() as u64 * 4)
            .sum();
        (
            entries.len(),
            entries.values().map(|entry| entry.bytes).sum(),
            fp32,
        )
    }

    /// The paths of the frozen weights among `ids` that no layer has read through
    /// [`weight_of`] since [`FrozenWeights::clear_reads`].
    pub fn unread(&self, ids: &HashSet<ParamId>) -> Vec<String> {
        let read = lock(&self.read);
        let mut paths: Vec<String> = lock(&self.entries)
            .iter()
            .filter(|(id, _)| ids.contains(id) && !read.contains(id))
            .map(|(_, entry)| entry.path.clone())
            .collect();
        paths.sort();
        paths
    }

    /// Forgets which weights were read.
    pub fn clear_reads(&self) {
        lock(&self.read).clear();
    }

    /// Whether any frozen weight is held.
    pub fn is_empty(&self) -> bool {
        lock(&self.entries).is_empty()
    }
}

/// The frozen weights of the run installed on this thread.
pub fn frozen_weights() -> std::sync::Arc<FrozenWeights> {
    crate::run::current().part::<FrozenWeights>()
}

fn compress<K: Backend>(weight: Tensor<K, 2>, dtype: FrozenDtype) -> (Held<K>, u64) {
    let [out, n] = weight.dims();
    match dtype {
        FrozenDtype::Bf16 => (Held::Bf16(weight.cast(DType::BF16)), (out * n * 2) as u64),
        FrozenDtype::Int8 => {
            let weight = weight.cast(DType::F32);
            let scales = weight
                .clone()
                .abs()
                .max_dim(1)
                .div_scalar(127.0)
                .clamp_min(f32::MIN_POSITIVE);
            let codes = weight
                .div(scales.clone())
                .round()
                .clamp(-127.0, 127.0)
                .add_scalar(127.0)
                .int()
                .cast(IntDType::U8);
            (Held::Int8 { codes, scales }, (out * n + out * 4) as u64)
        }
    }
}

fn expand_held<K: Backend>(held: &Held<K>, dtype: DType) -> Tensor<K, 2> {
    match held {
        Held::Bf16(weight) => weight.clone().cast(dtype),
        Held::Int8 { codes, scales } => codes
            .clone()
            .cast(IntDType::I32)
            .float()
            .sub_scalar(127.0)
            .mul(scales.clone())
            .cast(dtype),
    }
}

/// `param`'s value for a layer's forward, in `dtype` where it is frozen and held compressed
/// (dequantized for this use only), else its value as it is.
pub fn weight_of<B: Backend, const D: usize>(
    param: &Param<Tensor<B, D>>,
    dtype: DType,
) -> Tensor<B, D> {
    weight_in(&frozen_weights(), param, dtype)
}

/// [`weight_of`] in the table `frozen`.
fn weight_in<B: Backend, const D: usize>(
    frozen: &FrozenWeights,
    param: &Param<Tensor<B, D>>,
    dtype: DType,
) -> Tensor<B, D> {
    if frozen.is_empty() {
        return param.val();
    }
    let id = param.id;
    let mut entries = lock(&frozen.entries);
    let Some(entry) = entries.get_mut(&id) else {
        return param.val();
    };
    lock(&frozen.read).insert(id);
    let weight = match entry.held.downcast_ref::<Held<B>>() {
        Some(held) => expand_held(held, dtype),
        None => {
            // Held on another backend (the autodiff one, read by an evaluation on its inner
            // backend, or back): moved over through its data.
            let device = param.lazy_device();
            let moved = move_held::<B>(entry, &device);
            let weight = expand_held(&moved, dtype);
            entry.held = Box::new(moved);
            entry.reader = reader::<B>;
            weight
        }
    };
    let shape: [usize; D] = entry
        .shape
        .clone()
        .try_into()
        .expect("the parameter's rank");
    weight.reshape(shape)
}

/// An entry's values, held on another backend, as `Held<B>` (through host data).
fn move_held<B: Backend>(entry: &Entry, device: &B::Device) -> Held<B> {
    let data = (entry.reader)(entry.held.as_ref());
    match data.as_slice() {
        [weight] => Held::Bf16(Tensor::from_data(weight.clone(), device)),
        [codes, scales] => Held::Int8 {
            codes: Tensor::from_data(codes.clone(), device),
            scales: Tensor::from_data(scales.clone(), device),
        },
        _ => unreachable!("one or two tensors per entry"),
    }
}

/// Reads a `Held<K>`'s data, for the `K` it was made on.
type Reader = fn(&(dyn Any + Send + Sync)) -> Vec<TensorData>;

fn reader<K: Backend>(held: &(dyn Any + Send + Sync)) -> Vec<TensorData> {
    match held
        .downcast_ref::<Held<K>>()
        .expect("an entry's reader is its backend's")
    {
        Held::Bf16(weight) => vec![weight.to_data()],
        Held::Int8 { codes, scales } => vec![codes.to_data(), scales.to_data()],
    }
}

/// `module` with its frozen weights (not `require_grad`, of rank 2 or more: convolutions' and
/// linear layers' weights; biases and normalisations stay) moved into the run's table as
/// `dtype`, each replaced by a placeholder of its shape. Returns the module and the weights'
/// count and bytes held.
pub fn compress_frozen<B: Backend, M: Module<B>>(module: M, dtype: FrozenDtype) -> (M, usize, u64) {
    let paths = crate::train::params::param_paths::<B, M>(&module);
    let frozen = frozen_weights();
    struct Compress<'a> {
        dtype: FrozenDtype,
        frozen: &'a FrozenWeights,
        paths: &'a HashMap<ParamId, String>,
        count: usize,
        bytes: u64,
    }
    impl<B: Backend> ModuleMapper<B> for Compress<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if D < 2 || param.is_require_grad() {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.dims();
            let rest: usize = shape[1..].iter().product();
            let device = tensor.device();
            let dtype = tensor.dtype();
            let (held, bytes) = compress(tensor.reshape([shape[0], rest]), self.dtype);
            lock(&self.frozen.entries).insert(
                id,
                Entry {
                    shape: shape.to_vec(),
                    held: Box::new(held),
                    reader: reader::<B>,
                    bytes,
                    path: self.paths.get(&id).cloned().unwrap_or_default(),
                },
            );
            self.count += 1;
            self.bytes += bytes;
            let placeholder = Tensor::<B, 1>::zeros([1], &device)
                .cast(dtype)
                .reshape([1; D])
                .expand(shape);
            Param::from_mapped_value(id, placeholder, mapper)
        }
    }
    let paths: HashMap<ParamId, String> =
        paths.into_iter().map(|(id, path, _)| (id, path)).collect();
    let mut compress = Compress {
        dtype,
        frozen: &frozen,
        paths: &paths,
        count: 0,
        bytes: 0,
    };
    let module = module.map(&mut compress);
    (module, compress.count, compress.bytes)
}

/// `module` with each frozen weight held in `frozen` (a run's table) put back as its
/// dequantized value (fp32): for a snapshot, or the model a run hands back.
pub fn expand<B: Backend, M: Module<B>>(module: M, frozen: &FrozenWeights) -> M {
    struct Expand<'a>(&'a FrozenWeights);
    impl<B: Backend> ModuleMapper<B> for Expand<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if !lock(&self.0.entries).contains_key(&param.id) {
                return param;
            }
            let value = weight_in(self.0, &param, DType::F32);
            let (id, _, mapper) = param.consume();
            Param::from_mapped_value(id, value, mapper)
        }
    }
    if frozen.is_empty() {
        return module;
    }
    // Reading for a snapshot is not a layer's read.
    let read = lock(&frozen.read).clone();
    let module = module.map(&mut Expand(frozen));
    *lock(&frozen.read) = read;
    module
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_flex::Flex;

    #[test]
    fn int8_per_channel_is_within_half_a_step_of_each_channels_scale() {
        let device = Default::default();
        let values: Vec<f32> = (0..2 * 3 * 3 * 3)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * if i < 27 { 0.01 } else { 1.0 })
            .collect();
        let weight =
            Tensor::<Flex, 4>::from_data(TensorData::new(values.clone(), [2, 3, 3, 3]), &device);
        let (held, bytes) = compress(weight.reshape([2, 27]), FrozenDtype::Int8);
        assert_eq!(bytes, 2 * 27 + 2 * 4);
        let back = expand_held(&held, DType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for (channel, scale) in [(0usize, 0.11f32 / 127.0), (1, 11.0 / 127.0)] {
            for i in 0..27 {
                let (a, b) = (values[channel * 27 + i], back[channel * 27 + i]);
                assert!((a - b).abs() <= scale / 2.0 + 1e-7, "{a} {b}");
            }
        }
    }
}
