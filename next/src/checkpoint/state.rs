//! What a segment's recomputation must leave as the first forward left it: the random draws of
//! Burn's layers (replayed from a seed of the segment's own) and running statistics (BatchNorm's,
//! updated once per step, not once per forward).
//!
//! **Random draws.** Burn 0.22's `Dropout` draws from the backend's global generator when its
//! flag is on and its input's device is autodiff, which the untracked first forward and the
//! recomputation both keep. memsave can neither read nor rewind that generator, so a segment
//! whose module draws runs under a stream of its own: at its start it draws a seed from the
//! global stream and seeds the device with it (checkpointed or not, so that the plain run and
//! the checkpointed one draw alike); its recomputation seeds the device with the same seed again
//! and its layers draw the same masks. Whether a module draws is read from its layers' training
//! switches (`Param<Flag>`: Burn's `Dropout`, `GaussianNoise` and `RRelu` have one; `BatchNorm`'s
//! draws nothing, and `ModuleVisitor::enter_module` names the struct holding each field): no
//! trait to implement. A layer of the user's own that calls `Tensor::random` without a switch
//! says so with [`super::Options::random`].
//! After a recomputation the global stream is where the recomputation left it: the next step
//! draws other masks than without checkpointing (a different, equally random, sequence).
//!
//! **Running statistics.** Burn's `RunningState` (BatchNorm's running mean and variance) is
//! shared by every clone of its module and takes one update per thread per forward, merged into
//! its value by the next read. A recomputation is a second forward: left alone, it would move the
//! statistics twice per step. Its module's states are merged (`Module::valid`, which syncs them)
//! and saved before the recomputation, and merged and put back after it; the same before a
//! segment that falls back to running plainly after its untracked forward. This assumes one
//! training thread per module: where several threads' forwards share a module's states (Burn
//! averages their updates), the merge takes another thread's pending update alone and the write
//! back drops one made meanwhile. memsave's data parallelism gives each device a module of its
//! own; the port's slice that brings it checks this.

use burn::backend::{Dispatch, DispatchDevice, DispatchTensor, TensorMetadata};
use burn::module::{Flag, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Distribution, Int, Tensor};

use crate::backend;

/// Whether a training forward of `module` may draw from the backend's global random stream: it
/// holds a layer with an enabled training switch (a `Param<Flag>`) other than Burn's
/// `BatchNorm`, whose switch picks batch statistics and draws nothing. In burn-nn 0.22.1 those
/// layers are `Dropout`, `GaussianNoise` and `RRelu`; a user's layer with a switch of its own is
/// taken as drawing too (it costs the seed's two draws, the same checkpointed or not).
pub(crate) fn draws_random<M: Module>(module: &M) -> bool {
    let mut visitor = Draws::default();
    module.visit(&mut visitor);
    visitor.draws
}

#[derive(Default)]
struct Draws {
    /// Whether each container entered is a `BatchNorm`, innermost last.
    path: Vec<bool>,
    draws: bool,
}

impl ModuleVisitor for Draws {
    fn enter_module(&mut self, _name: &str, container_type: &str) {
        // Burn's derive names the struct that holds the field being entered.
        self.path.push(container_type == "Struct:BatchNorm");
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_flag(&mut self, flag: &Param<Flag>) {
        if self.path.last() != Some(&true) && flag.val().is_enabled() {
            self.draws = true;
        }
    }
}

/// Initializes `module`'s parameters now, at a fixed point of the stream (before a segment's
/// seed is drawn). Burn initializes a parameter on its first use, from the global random stream:
/// first used inside a segment, it would draw from the segment's stream in the first forward and
/// not in the recomputation, and in another order with checkpointing than without. And
/// `no_grad()` on a parameter not yet initialized would freeze it for good (its switch is shared
/// by every clone until it is initialized).
pub(crate) fn initialize<M: Module>(module: &M) {
    module.visit(&mut Initialize);
}

/// A seed drawn from the global stream of `device` (as much of it as two draws).
pub(crate) fn draw_seed(device: &burn::tensor::Device) -> u64 {
    let halves = Tensor::<1, Int>::random([2], Distribution::Uniform(0.0, 2147483647.0), device)
        .into_data()
        .convert::<i64>();
    halves
        .iter::<i64>()
        .fold(0_u64, |seed, half| (seed << 31) ^ half as u64)
}

/// A seed for a segment's own stream, drawn from the global stream of `device`, and given to
/// the device.
pub(crate) fn seed_own_stream(device: &DispatchDevice) -> u64 {
    let seed = draw_seed(&device.clone().into());
    reseed(device, seed);
    seed
}

/// Initializes each float parameter it visits (reading it does).
struct Initialize;

impl ModuleVisitor for Initialize {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        drop(param.val());
    }
}

/// Gives `seed` to the generator of `device` again.
pub(crate) fn reseed(device: &DispatchDevice, seed: u64) {
    <Dispatch as burn::backend::Backend>::seed(device, seed);
}

/// The device of a float tensor.
pub(crate) fn device_of(tensor: &DispatchTensor) -> DispatchDevice {
    tensor.device()
}

/// The values of a module's untracked float tensors (its running states, and frozen parameters),
/// after merging the running states' pending updates.
pub(crate) struct Running(Vec<(ParamId, DispatchTensor)>);

impl Running {
    /// Saved from `module`, or `None` when it has no untracked float tensor (nothing a forward
    /// could move).
    pub(crate) fn save<M: Module>(module: &M) -> Option<Self> {
        let mut untracked = Untracked(Vec::new());
        module.visit(&mut untracked);
        if untracked.0.is_empty() {
            return None;
        }
        // Merges every running state's pending updates into its value (the values are shared
        // with `module`); the copy itself is not needed.
        drop(module.valid());
        let mut untracked = Untracked(Vec::new());
        module.visit(&mut untracked);
        Some(Running(untracked.0))
    }

    /// Puts the saved values back into `module`'s running states, dropping whatever a forward
    /// since [`Running::save`] updated them with.
    pub(crate) fn restore<M: Module>(self, module: &M) {
        drop(module.valid());
        // A running state's value is shared by every clone of its module: writing it through a
        // clone writes the original's. The clone's own parameters are dropped with it.
        drop(module.clone().map(&mut Restore(self.0)));
    }
}

struct Untracked(Vec<(ParamId, DispatchTensor)>);

impl ModuleVisitor for Untracked {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val().into_dispatch();
        if !backend::is_tracked(&tensor) {
            self.0.push((param.id, tensor));
        }
    }
}

struct Restore(Vec<(ParamId, DispatchTensor)>);

impl ModuleMapper for Restore {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match self.0.iter().position(|(id, _)| *id == param.id) {
            Some(index) => {
                let (_, saved) = self.0.swap_remove(index);
                param.map(|_| Tensor::from_dispatch(saved))
            }
            None => param,
        }
    }
}
