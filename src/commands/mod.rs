//! The subcommands: `train`, `test`, `bench`, `plan`, `data`, `orchestrator`.

pub mod bench;
pub mod data;
pub mod orchestrator;
pub mod plan;
pub mod test;
pub mod train;
pub mod worker;

use clap::ValueEnum;

/// Where to run.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Device {
    /// Flex, on the CPU.
    Cpu,
    /// CubeCL's CUDA backend (built with `--features cuda`).
    Cuda,
}

/// The error for `--device cuda` in a build without CUDA.
#[cfg(not(feature = "cuda"))]
pub fn no_cuda() -> memsave::Error {
    memsave::Error::invalid(
        "--device",
        "this memsave was built without CUDA: rebuild with `--features cuda`",
    )
}
