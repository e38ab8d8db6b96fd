//! Burn 0.22's tensors carry no backend type: a `Tensor<D>` holds a `DispatchTensor` whose kind
//! names the backend it lives on (Flex, CubeCL, ...), wrapped once more where autodiff is on.
//! memsave's ops are generic code over a backend `B` (burn-autodiff's `Backward<B, N>` steps,
//! kernels); this module finds `B` from a tensor and runs that code on it.
//!
//! A backend memsave runs on implements [`DispatchBackend`] (how its tensors are taken out of
//! and put back into a `DispatchTensor`), and one arm of [`on_backend`] names it. A tensor on
//! any other backend is an error naming the backend.

use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Backend, BackendTensor, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind, Flex,
};
use burn::tensor::GradientCheckpointingStrategy;

/// An autodiff tensor primitive of backend `B` (the same type for every checkpointing
/// strategy).
pub type AdTensor<B> = FloatTensor<Autodiff<B>>;

/// A backend of Burn's dispatch on which memsave's ops run.
pub trait DispatchBackend: Backend {
    /// The backend's name, for messages.
    const NAME: &'static str;

    /// The autodiff primitive of a float tensor of this backend.
    fn autodiff_of(tensor: DispatchTensor) -> AdTensor<Self>;

    /// The plain primitive of a float tensor of this backend (its autodiff wrapper, if any,
    /// dropped).
    fn plain_of(tensor: DispatchTensor) -> FloatTensor<Self>;

    /// An autodiff primitive as a dispatch tensor under `strategy`.
    fn from_autodiff(
        tensor: AdTensor<Self>,
        strategy: GradientCheckpointingStrategy,
    ) -> DispatchTensor;

    /// A plain primitive as a dispatch tensor (autodiff off).
    fn from_plain(tensor: FloatTensor<Self>) -> DispatchTensor;
}

/// Generic code run on the backend a tensor lives on ([`on_backend`]).
pub trait OnBackend {
    type Output;

    /// Runs on backend `B`; `strategy` is the tensor's checkpointing strategy where autodiff is
    /// on.
    fn run<B: DispatchBackend>(
        self,
        strategy: Option<GradientCheckpointingStrategy>,
    ) -> Self::Output;
}

/// A tensor on a backend memsave has no ops for.
#[derive(Debug, Clone, PartialEq)]
pub struct UnsupportedBackend(pub String);

impl std::fmt::Display for UnsupportedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memsave has no ops for tensors on the {} backend (it runs on Flex; CubeCL comes with \
             the port's next slices)",
            self.0
        )
    }
}

impl std::error::Error for UnsupportedBackend {}

fn strategy_of(tensor: &DispatchTensor) -> Option<GradientCheckpointingStrategy> {
    match tensor.autodiff {
        DispatchAutodiffContext::Enabled(strategy) => Some(strategy),
        DispatchAutodiffContext::Disabled => None,
    }
}

fn name_of(kind: &DispatchTensorKind) -> String {
    let debug = format!("{kind:?}");
    debug
        .split(|c: char| !c.is_alphanumeric())
        .find(|word| !word.is_empty() && *word != "Autodiff")
        .unwrap_or("unknown")
        .to_string()
}

/// Runs `op` on the backend `tensor` lives on.
pub fn on_backend<O: OnBackend>(
    tensor: &DispatchTensor,
    op: O,
) -> Result<O::Output, UnsupportedBackend> {
    let strategy = strategy_of(tensor);
    let inner = match &tensor.kind {
        DispatchTensorKind::Autodiff(inner) => inner.as_ref(),
        kind => kind,
    };
    #[allow(unreachable_patterns)]
    match inner {
        DispatchTensorKind::Flex(_) => Ok(op.run::<Flex>(strategy)),
        other => Err(UnsupportedBackend(name_of(other))),
    }
}

/// Whether `tensor` is recorded in an autodiff graph: a leaf that requires grad or a result of
/// one (PyTorch's `requires_grad`).
pub fn is_tracked(tensor: &DispatchTensor) -> bool {
    // Only float tensors are wrapped by autodiff; a quantized tensor on an autodiff device is
    // not (burn-dispatch `ops/qtensor.rs`), and is a constant here.
    if !is_autodiff_float(tensor) {
        return false;
    }
    struct Tracked<'a>(&'a DispatchTensor);
    impl OnBackend for Tracked<'_> {
        type Output = bool;
        fn run<B: DispatchBackend>(self, strategy: Option<GradientCheckpointingStrategy>) -> bool {
            strategy.is_some() && B::autodiff_of(self.0.clone()).is_tracked()
        }
    }
    on_backend(tensor, Tracked(tensor)).unwrap_or(false)
}

macro_rules! dispatch_backend {
    ($backend:ident) => {
        impl DispatchBackend for $backend {
            const NAME: &'static str = stringify!($backend);

            fn autodiff_of(tensor: DispatchTensor) -> AdTensor<Self> {
                match tensor.kind {
                    DispatchTensorKind::Autodiff(inner) => match *inner {
                        DispatchTensorKind::$backend(BackendTensor::Autodiff(tensor)) => tensor,
                        other => panic!(
                            "expected an autodiff float tensor on {}, got {other:?}",
                            Self::NAME
                        ),
                    },
                    other => panic!(
                        "expected an autodiff float tensor on {}, got {other:?}",
                        Self::NAME
                    ),
                }
            }

            fn plain_of(tensor: DispatchTensor) -> FloatTensor<Self> {
                match tensor.kind {
                    DispatchTensorKind::Autodiff(inner) => match *inner {
                        DispatchTensorKind::$backend(BackendTensor::Autodiff(tensor)) => {
                            tensor.into_primitive()
                        }
                        other => panic!("expected a float tensor on {}, got {other:?}", Self::NAME),
                    },
                    DispatchTensorKind::$backend(BackendTensor::Float(tensor)) => tensor,
                    other => panic!("expected a float tensor on {}, got {other:?}", Self::NAME),
                }
            }

            fn from_autodiff(
                tensor: AdTensor<Self>,
                strategy: GradientCheckpointingStrategy,
            ) -> DispatchTensor {
                DispatchTensor {
                    kind: DispatchTensorKind::Autodiff(Box::new(DispatchTensorKind::$backend(
                        BackendTensor::Autodiff(tensor),
                    ))),
                    autodiff: DispatchAutodiffContext::Enabled(strategy),
                }
            }

            fn from_plain(tensor: FloatTensor<Self>) -> DispatchTensor {
                DispatchTensor {
                    kind: DispatchTensorKind::$backend(BackendTensor::Float(tensor)),
                    autodiff: DispatchAutodiffContext::Disabled,
                }
            }
        }
    };
}

dispatch_backend!(Flex);

/// Whether `tensor` is a float tensor on an autodiff device (Burn wraps those alone).
pub fn is_autodiff_float(tensor: &DispatchTensor) -> bool {
    matches!(tensor.kind, DispatchTensorKind::Autodiff(_))
}

/// Whether memsave has ops for the backend `tensor` lives on.
pub fn supported(tensor: &DispatchTensor) -> Result<(), UnsupportedBackend> {
    struct Probe;
    impl OnBackend for Probe {
        type Output = ();
        fn run<B: DispatchBackend>(self, _: Option<GradientCheckpointingStrategy>) {}
    }
    on_backend(tensor, Probe)
}
