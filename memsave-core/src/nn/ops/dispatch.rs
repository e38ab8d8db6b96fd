//! Which backends have memsave's lean ops: a registry of [`LeanBackend`]s, found at run time
//! from a tensor's type so that layers stay generic over any `B: Backend`.
//!
//! An entry is keyed by a float tensor type: `Autodiff<K, C>`'s is `AutodiffTensor<K>` for
//! every checkpoint strategy `C` (Burn's `NoCheckpointing`, `BalancedCheckpointing`), so one
//! entry serves them all; `K`'s own (untracked: the norms only) is a second entry. CubeCL's
//! tensors carry their element type at run time, so one entry per runtime serves every element
//! type (`Cuda<f16>` and `Cuda` alike).
//!
//! Calls cross the registry as [`Box<dyn Any>`] of the `*Parts` types, generic over the tensor
//! type rather than the backend, so that a call made on `Autodiff<K, C>` is one made on
//! `Autodiff<K>`.

use std::any::{type_name, Any, TypeId};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{OnceLock, RwLock};

use burn::backend::Autodiff;
use burn::prelude::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};

use super::super::kernels::{Act, Grouping, LeanBackend, View};
use super::fused::{ConvSpec, NormSpec};
use super::{Normalised, PoolSpec, Statistics};

/// A call's arguments or result, boxed; handed back (`Err`) by an entry that does not take it.
pub(super) type Call = Box<dyn Any>;

/// The lean ops of one backend, type-erased. Each op takes its arguments as the `*Parts` of
/// the backend's tensor type and returns its result, or hands the arguments back (the default:
/// the caller runs the backend's own op).
pub(super) trait Lean: Send + Sync {
    /// The backend, by its Rust type name.
    fn backend(&self) -> &'static str;
    /// See [`LeanBackend::host_resident`].
    fn host_resident(&self) -> bool;
    /// `(T, NormParts<T>)` -> `OutParts<T>`.
    fn normalise(&self, call: Call) -> Result<Call, Call>;
    /// `T` -> `T`.
    fn relu(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, T)` (same shapes) -> `T`.
    fn add(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, ConvParts<T>)` -> `T`.
    fn conv2d(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, T, Option<T>)` -> `T`.
    fn linear(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, PoolSpec)` -> `T`.
    fn max_pool2d(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, NormParts<T>, ConvParts<T>)` -> `OutParts<T>`.
    fn norm_act_conv(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, ConvParts<T>, NormParts<T>)` -> `OutParts<T>`.
    fn conv_norm(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, NormParts<T>, PoolSpec)` -> `OutParts<T>`.
    fn norm_act_pool(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(T, Vec<f32>, usize)` -> `Option<(IntT, T)>` (see `LeanBackend::quantize_blocks`).
    fn quantize_blocks(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
    /// `(IntT, T, Vec<f32>, usize)` -> `Option<T>` (see `LeanBackend::dequantize_blocks`).
    fn dequantize_blocks(&self, call: Call) -> Result<Call, Call> {
        Err(call)
    }
}

/// [`Statistics`] over a tensor type.
pub(super) enum StatsParts<T> {
    Batch,
    Recorded(T, T),
    Running(T, T),
}

/// [`NormSpec`] over a tensor type.
pub(super) struct NormParts<T> {
    gamma: T,
    beta: T,
    statistics: StatsParts<T>,
    view: View,
    grouping: Grouping,
    act: Act,
    epsilon: f64,
}

/// [`ConvSpec`] over a tensor type.
pub(super) struct ConvParts<T> {
    weight: T,
    bias: Option<T>,
    options: ConvOptions<2>,
}

/// [`Normalised`] over a tensor type.
pub(super) struct OutParts<T> {
    output: T,
    batch_stats: Option<(T, T)>,
}

impl<B: Backend> Statistics<B> {
    fn into_parts(self) -> StatsParts<FloatTensor<B>> {
        match self {
            Statistics::Batch => StatsParts::Batch,
            Statistics::Recorded { mean, var } => StatsParts::Recorded(mean, var),
            Statistics::Running { mean, var } => StatsParts::Running(mean, var),
        }
    }

    fn from_parts(parts: StatsParts<FloatTensor<B>>) -> Self {
        match parts {
            StatsParts::Batch => Statistics::Batch,
            StatsParts::Recorded(mean, var) => Statistics::Recorded { mean, var },
            StatsParts::Running(mean, var) => Statistics::Running { mean, var },
        }
    }
}

impl<B: Backend> NormSpec<B> {
    pub(super) fn into_parts(self) -> NormParts<FloatTensor<B>> {
        NormParts {
            gamma: self.gamma,
            beta: self.beta,
            statistics: self.statistics.into_parts(),
            view: self.view,
            grouping: self.grouping,
            act: self.act,
            epsilon: self.epsilon,
        }
    }

    pub(super) fn from_parts(parts: NormParts<FloatTensor<B>>) -> Self {
        NormSpec {
            gamma: parts.gamma,
            beta: parts.beta,
            statistics: Statistics::from_parts(parts.statistics),
            view: parts.view,
            grouping: parts.grouping,
            act: parts.act,
            epsilon: parts.epsilon,
        }
    }
}

impl<B: Backend> ConvSpec<B> {
    pub(super) fn into_parts(self) -> ConvParts<FloatTensor<B>> {
        ConvParts {
            weight: self.weight,
            bias: self.bias,
            options: self.options,
        }
    }

    pub(super) fn from_parts(parts: ConvParts<FloatTensor<B>>) -> Self {
        ConvSpec {
            weight: parts.weight,
            bias: parts.bias,
            options: parts.options,
        }
    }
}

impl<B: Backend> Normalised<B> {
    pub(super) fn into_parts(self) -> OutParts<FloatTensor<B>> {
        OutParts {
            output: self.output,
            batch_stats: self.batch_stats,
        }
    }

    pub(super) fn from_parts(parts: OutParts<FloatTensor<B>>) -> Self {
        Normalised {
            output: parts.output,
            batch_stats: parts.batch_stats,
        }
    }
}

/// The arguments of a call made on `Autodiff<K>` (or `K`): what the registry keyed by this
/// tensor type handed over.
fn take<A: 'static>(call: Call) -> A {
    *call
        .downcast::<A>()
        .ok()
        .expect("the registry's key is the call's tensor type")
}

/// A call's result as the caller's type.
pub(super) fn result<R: 'static>(call: Call) -> R {
    take(call)
}

/// `Autodiff<K, _>`'s lean ops: each one node of Burn's graph.
struct Tracked<K>(PhantomData<fn() -> K>);

/// `K`'s own: the normalisation's fused loops without a graph; the rest are `K`'s ops (without a
/// graph there is nothing to keep).
struct Untracked<K>(PhantomData<fn() -> K>);

type T<K> = FloatTensor<Autodiff<K>>;
type Ad<K> = Autodiff<K>;

impl<K: LeanBackend> Lean for Tracked<K> {
    fn backend(&self) -> &'static str {
        type_name::<K>()
    }

    fn host_resident(&self) -> bool {
        K::host_resident()
    }

    fn normalise(&self, call: Call) -> Result<Call, Call> {
        let (x, norm): (T<K>, NormParts<T<K>>) = take(call);
        let norm = NormSpec::<Ad<K>>::from_parts(norm);
        let out = super::norm::tracked::<K>(
            x,
            norm.gamma,
            norm.beta,
            norm.statistics,
            norm.view,
            norm.grouping,
            norm.act,
            norm.epsilon,
        );
        Ok(Box::new(out.into_parts()))
    }

    fn relu(&self, call: Call) -> Result<Call, Call> {
        let x: T<K> = take(call);
        Ok(Box::new(super::relu::relu_keeping_output::<K>(x)))
    }

    fn add(&self, call: Call) -> Result<Call, Call> {
        let (a, b): (T<K>, T<K>) = take(call);
        Ok(Box::new(super::relu::add_keeping_nothing::<K>(a, b)))
    }

    fn conv2d(&self, call: Call) -> Result<Call, Call> {
        let (x, conv): (T<K>, ConvParts<T<K>>) = take(call);
        let out = super::conv::tracked_conv2d::<K>(x, conv.weight, conv.bias, conv.options);
        Ok(Box::new(out))
    }

    fn linear(&self, call: Call) -> Result<Call, Call> {
        let (x, weight, bias): (T<K>, T<K>, Option<T<K>>) = take(call);
        Ok(Box::new(super::linear::tracked_linear::<K>(
            x, weight, bias,
        )))
    }

    fn max_pool2d(&self, call: Call) -> Result<Call, Call> {
        let (x, pool): (T<K>, PoolSpec) = take(call);
        let options = super::pool::PoolOptions {
            kernel: pool.kernel,
            stride: pool.stride,
            padding: pool.padding,
            dilation: pool.dilation,
            ceil_mode: pool.ceil_mode,
        };
        Ok(Box::new(super::pool::tracked_max_pool2d::<K>(x, options)))
    }

    fn norm_act_conv(&self, call: Call) -> Result<Call, Call> {
        let (x, norm, conv): (T<K>, NormParts<T<K>>, ConvParts<T<K>>) = take(call);
        let out = super::fused::tracked_norm_act_conv::<K>(
            x,
            NormSpec::from_parts(norm),
            ConvSpec::from_parts(conv),
        );
        Ok(Box::new(out.into_parts()))
    }

    fn conv_norm(&self, call: Call) -> Result<Call, Call> {
        let (x, conv, norm): (T<K>, ConvParts<T<K>>, NormParts<T<K>>) = take(call);
        let out = super::shared::tracked_conv_norm::<K>(
            x,
            ConvSpec::from_parts(conv),
            NormSpec::from_parts(norm),
        );
        Ok(Box::new(out.into_parts()))
    }

    fn norm_act_pool(&self, call: Call) -> Result<Call, Call> {
        let (x, norm, pool): (T<K>, NormParts<T<K>>, PoolSpec) = take(call);
        let out = super::shared::tracked_norm_act_pool::<K>(x, NormSpec::from_parts(norm), pool);
        Ok(Box::new(out.into_parts()))
    }
}

impl<K: LeanBackend> Lean for Untracked<K> {
    fn backend(&self) -> &'static str {
        type_name::<K>()
    }

    fn host_resident(&self) -> bool {
        K::host_resident()
    }

    fn normalise(&self, call: Call) -> Result<Call, Call> {
        let (x, norm): (FloatTensor<K>, NormParts<FloatTensor<K>>) = take(call);
        let norm = NormSpec::<K>::from_parts(norm);
        let out = super::norm::untracked::<K>(
            x,
            norm.gamma,
            norm.beta,
            norm.statistics,
            norm.view,
            norm.grouping,
            norm.act,
            norm.epsilon,
        );
        Ok(Box::new(out.into_parts()))
    }

    fn quantize_blocks(&self, call: Call) -> Result<Call, Call> {
        let (x, map, block): (FloatTensor<K>, Vec<f32>, usize) = take(call);
        Ok(Box::new(K::quantize_blocks(&x, &map, block)))
    }

    fn dequantize_blocks(&self, call: Call) -> Result<Call, Call> {
        let (codes, absmax, map, block): (IntTensor<K>, FloatTensor<K>, Vec<f32>, usize) =
            take(call);
        Ok(Box::new(K::dequantize_blocks(&codes, &absmax, &map, block)))
    }
}

type Registry = RwLock<HashMap<TypeId, &'static dyn Lean>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry = RwLock::new(HashMap::new());
        builtin(&registry);
        registry
    })
}

fn insert<K: LeanBackend>(registry: &Registry) {
    let mut map = registry.write().unwrap_or_else(|e| e.into_inner());
    map.entry(TypeId::of::<FloatTensor<Autodiff<K>>>())
        .or_insert_with(|| Box::leak(Box::new(Tracked::<K>(PhantomData))));
    map.entry(TypeId::of::<FloatTensor<K>>())
        .or_insert_with(|| Box::leak(Box::new(Untracked::<K>(PhantomData))));
}

/// Burn's backends whose feature is on.
fn builtin(registry: &Registry) {
    insert::<burn::backend::Flex>(registry);
    #[cfg(feature = "cuda")]
    {
        insert::<burn::backend::Cuda>(registry);
        #[cfg(feature = "fusion")]
        insert::<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>(registry);
    }
    #[cfg(feature = "wgpu")]
    {
        insert::<burn::backend::Wgpu>(registry);
        #[cfg(feature = "fusion")]
        insert::<burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>>(registry);
    }
}

/// Registers `K` (and `Autodiff<K>` with any checkpoint strategy) as a backend with memsave's
/// lean ops: needed only for a backend that is not one of Burn's built with memsave's feature
/// for it (`Flex` always; `Cuda` with `cuda`; `Wgpu` with `wgpu`), e.g. a
/// `CubeBackend<HipRuntime, ..>` (ROCm) or a backend of your own that implements
/// [`LeanBackend`]. Registering twice is harmless.
pub fn register_backend<K: LeanBackend>() {
    insert::<K>(registry());
}

/// Whether `B`'s layers run memsave's lean ops (else Burn's composed ones).
pub fn is_lean<B: Backend>() -> bool {
    let map = registry().read().unwrap_or_else(|e| e.into_inner());
    map.contains_key(&TypeId::of::<FloatTensor<B>>())
}

/// Whether `B`'s tensors live in the host's memory ([`LeanBackend::host_resident`]; `Autodiff<K>`
/// answers for `K`); `None` for a backend that is not registered.
pub fn host_resident<B: Backend>() -> Option<bool> {
    let map = registry().read().unwrap_or_else(|e| e.into_inner());
    map.get(&TypeId::of::<FloatTensor<B>>())
        .map(|lean| lean.host_resident())
}

/// The names of the backends registered so far, tracked ones as `Autodiff<..>`.
pub fn lean_backends() -> Vec<String> {
    let map = registry().read().unwrap_or_else(|e| e.into_inner());
    let mut names: Vec<String> = map
        .values()
        .map(|lean| lean.backend().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// `B`'s lean ops, if registered. A backend that differentiates (`Backend::ad_enabled`) but
/// has none is named once per run (a `tracing` warning), with what falls back.
pub(super) fn lean<B: Backend>(device: &B::Device) -> Option<&'static dyn Lean> {
    let key = TypeId::of::<FloatTensor<B>>();
    if let Some(lean) = registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
    {
        return Some(*lean);
    }
    if B::ad_enabled(device) {
        let told = crate::run::current().part::<Told>();
        let first = told.0.lock().unwrap_or_else(|e| e.into_inner()).insert(key);
        if first {
            tracing::warn!(
                target: "memsave",
                backend = type_name::<B>(),
                "{}",
                fallback_message::<B>()
            );
        }
    }
    None
}

/// The backends a run has told it falls back for (a part of the run's state).
#[derive(Default)]
struct Told(std::sync::Mutex<std::collections::HashSet<TypeId>>);

/// What a backend without lean ops is told, once.
pub(crate) fn fallback_message<B: Backend>() -> String {
    format!(
        "backend `{}` has no memsave lean ops: normalisations, ReLU, convolutions, linear \
         layers and max pooling run as Burn's composed ops, which keep more for backward \
         (its inner backend must implement `memsave::nn::kernels::LeanBackend` and be \
         registered with `memsave::nn::register_backend`)",
        type_name::<B>()
    )
}

/// Runs `op` of `B`'s lean ops on `args`, or hands `args` back where `B` has none or the op
/// is not taken.
pub(super) fn run<B: Backend, A: 'static, R: 'static>(
    device: &B::Device,
    op: fn(&'static dyn Lean, Call) -> Result<Call, Call>,
    args: A,
) -> Result<R, A> {
    let Some(lean) = lean::<B>(device) else {
        return Err(args);
    };
    match op(lean, Box::new(args)) {
        Ok(out) => Ok(result(out)),
        Err(args) => Err(take(args)),
    }
}
