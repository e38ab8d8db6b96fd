//! What the runner reads off a model: its parameters' shapes (a snapshot's signature), their
//! bytes (the memory check), and whether it has BatchNorm (a warning).

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

/// Bytes of `model`'s float parameters: all of them, and the trainable ones.
pub fn param_bytes<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> (u64, u64) {
    struct Bytes(u64, u64);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Bytes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let bytes = (value.shape().num_elements() * value.dtype().size()) as u64;
            self.0 += bytes;
            if value.is_require_grad() {
                self.1 += bytes;
            }
        }
    }
    let mut bytes = Bytes(0, 0);
    model.visit(&mut bytes);
    (bytes.0, bytes.1)
}

/// The elements of `model`'s trainable float parameters.
pub(crate) fn trainable_elements<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> u64 {
    struct Elements(u64);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Elements {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0 += value.shape().num_elements() as u64;
            }
        }
    }
    let mut elements = Elements(0);
    model.visit(&mut elements);
    elements.0
}

/// The peers whose optimizer offload shares one host's memory: those of this process. A host
/// budget (`[memory] host_budget`) is the machine's, so it holds all of theirs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OnThisHost {
    /// The number of peers in the run.
    pub world: usize,
    /// The ranks of the peers in this process.
    pub local: std::ops::Range<usize>,
    /// Whether each peer keeps the state and masters of its own part only (ZeRO stage 1 or 2).
    pub sharded: bool,
}

impl OnThisHost {
    /// Training alone.
    pub fn alone() -> Self {
        OnThisHost {
            world: 1,
            local: 0..1,
            sharded: false,
        }
    }

    /// The peers of the process `place` is in, each keeping its part where `sharded`.
    pub fn of(place: &crate::train::PeerPlace, sharded: bool) -> Self {
        OnThisHost {
            world: place.world_size.max(1),
            local: place.local_ranks(),
            sharded,
        }
    }
}

/// What optimizer offload keeps in host memory (see [`OffloadedOptimizer::of`]): for every
/// peer on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffloadedOptimizer {
    /// The fp32 master weights.
    pub masters: u64,
    /// The optimizer's state.
    pub state: u64,
    /// The group's fp32 gradient sums (under accumulation, training alone; else 0).
    pub sums: u64,
    /// The peers they are for (1 training alone).
    pub peers: usize,
    /// The data-parallel run's peers in all (1 training alone).
    pub world: usize,
    /// Whether each peer keeps only its part (ZeRO 1 or 2).
    pub sharded: bool,
}

impl OffloadedOptimizer {
    /// For `model`'s trainable parameters, on the peers `host` says: the fp32 masters of the
    /// parameters each steps (every one, or under ZeRO its part, as balanced by
    /// [`crate::parallel::zero::owned_bytes`]), the optimizer's state at `state_per_weight`
    /// fp32 copies of them (8-bit state: its share), and, training alone where it
    /// `accumulates`, the group's fp32 sums (with peers the sums stay on the device).
    pub fn of<B: AutodiffBackend, M: AutodiffModule<B>>(
        model: &M,
        state_per_weight: f64,
        accumulates: bool,
        host: &OnThisHost,
    ) -> Self {
        let whole = trainable_elements(model) * 4;
        let alone = host.world <= 1;
        let peers = host.local.len().max(1);
        let masters = if alone {
            whole
        } else if host.sharded {
            let owned = crate::parallel::zero::owned_bytes::<B, M>(model, host.world);
            host.local.clone().filter_map(|rank| owned.get(rank)).sum()
        } else {
            whole * peers as u64
        };
        OffloadedOptimizer {
            masters,
            state: (masters as f64 * state_per_weight) as u64,
            sums: if alone && accumulates { whole } else { 0 },
            peers: if alone { 1 } else { peers },
            world: host.world.max(1),
            sharded: host.sharded,
        }
    }

    /// All of it.
    pub fn total(&self) -> u64 {
        self.masters + self.state + self.sums
    }

    /// What a host budget of `budget` bytes leaves once this is held: the host bytes
    /// activation offload may use. The one place CPU staging's host budget is counted (the
    /// check before a run, and the limit activation offload keeps); an error naming
    /// `offload.optimizer`, what it needs and what to change where this alone does not fit.
    pub fn within(&self, budget: u64) -> crate::Result<u64> {
        use crate::memory::human;
        let needed = self.total();
        if needed <= budget {
            return Ok(budget - needed);
        }
        let zero_said = if self.world > 1 && !self.sharded {
            ", shard it across the peers (`optimizer_config.zero_stage = 1`)"
        } else {
            ""
        };
        let peers_said = match (self.peers, self.sharded) {
            (1, _) => String::new(),
            (peers, true) => format!(" for the {peers} peers of this process (each its part)"),
            (peers, false) => format!(" for the {peers} peers of this process (a set each)"),
        };
        let sums_said = if self.sums > 0 {
            format!(", the group's gradient sums ({})", human(self.sums))
        } else {
            String::new()
        };
        Err(crate::Error::invalid(
            "offload.optimizer",
            format!(
                "the host must hold the fp32 master weights ({}) and the optimizer's state \
                 ({}){sums_said}{peers_said}, {} in all, and `[memory] host_budget` (by default \
                 half the machine's available memory) leaves {}: raise `memory.host_budget`, \
                 keep the state in 8 bits (`optimizer.state_dtype = \"int8\"`, a quarter of \
                 it){zero_said}, or turn optimizer offload off",
                human(self.masters),
                human(self.state),
                human(needed),
                human(budget),
            ),
        ))
    }
}

/// The trainable float parameters of `model` in visiting order: each one's module path
/// (`backbone.layer1.0.conv1`) and bytes (a gradient's: the parameter's own precision). Where
/// a device's meter cannot tell gradients from other bytes, the planner estimates the gradients
/// live at each moment of backward from it.
pub fn trainable_layout<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> Vec<(String, u64)> {
    struct Layout {
        path: Vec<String>,
        params: Vec<(String, u64)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Layout {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            if value.is_require_grad() {
                let bytes = (value.shape().num_elements() * value.dtype().size()) as u64;
                self.params.push((self.path.join("."), bytes));
            }
        }
    }
    let mut layout = Layout {
        path: Vec::new(),
        params: Vec::new(),
    };
    model.visit(&mut layout);
    layout.params
}

/// Whether `model` contains a BatchNorm (memsave's or Burn's), found by its type name.
pub(crate) fn has_batch_norm<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> bool {
    struct Find(bool);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Find {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            self.0 |= container_type == "Struct:BatchNorm";
        }
    }
    let mut find = Find(false);
    model.visit(&mut find);
    find.0
}

/// Parameter ids with their shapes, in visiting order: a model's signature, to check that a
/// checkpoint belongs to it.
pub(crate) fn param_shapes<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
) -> Vec<(ParamId, Vec<usize>)> {
    struct Shapes(Vec<(ParamId, Vec<usize>)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0
                .push((param.id, param.lazy_shape().dims::<D>().to_vec()));
        }
    }
    let mut shapes = Shapes(Vec::new());
    model.visit(&mut shapes);
    shapes.0
}

/// Each float parameter of `model` in visiting order: its id, module path
/// (`backbone.layer1.0.conv1.weight`) and dtype.
pub fn param_paths<B: burn::prelude::Backend, M: burn::module::Module<B>>(
    model: &M,
) -> Vec<(ParamId, String, burn::tensor::DType)> {
    struct Paths {
        path: Vec<String>,
        params: Vec<(ParamId, String, burn::tensor::DType)>,
    }
    impl<B: burn::prelude::Backend> ModuleVisitor<B> for Paths {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let parts: Vec<&str> = self
                .path
                .iter()
                .map(String::as_str)
                .filter(|part| !part.is_empty())
                .collect();
            self.params
                .push((param.id, parts.join("."), param.val().dtype()));
        }
    }
    let mut paths = Paths {
        path: Vec::new(),
        params: Vec::new(),
    };
    model.visit(&mut paths);
    paths.params
}

/// The module path of the first float parameter of `model` that is not fp32 (a model wrapped by
/// `wrap_fp16_model`), if any.
pub fn first_half_param<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> Option<String> {
    param_paths(model)
        .into_iter()
        .find(|(_, _, dtype)| *dtype != burn::tensor::DType::F32)
        .map(|(_, path, _)| path)
}
