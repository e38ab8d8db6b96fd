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
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// Flex, on the CPU.
    Cpu,
    /// CubeCL's CUDA backend (built with `--features cuda`).
    Cuda,
    /// Burn's wgpu backend: Vulkan, Metal or DX12 (built with `--features wgpu`, or `vulkan`
    /// for the SPIR-V compiler).
    #[value(alias = "vulkan", alias = "metal")]
    Wgpu,
}

impl Device {
    /// The flag's value, for a worker's command line.
    pub fn as_arg(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Wgpu => "wgpu",
        }
    }

    /// The device in words for a report, after checking that its runtime can start: an error
    /// naming the device and the runtime's words where it cannot (no driver, no adapter).
    pub fn describe(self) -> memsave::Result<String> {
        match self {
            Device::Cpu => {
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                Ok(format!("CPU, {threads} threads (Flex)"))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                memsave::memory::cuda::probe(&Default::default()).map_err(|message| {
                    memsave::Error::invalid(
                        "--device",
                        format!(
                            "CUDA is not usable here (no NVIDIA driver or device?): install \
                             NVIDIA's driver (libcuda.so.1; no CUDA toolkit is needed), or use \
                             `--device cpu`; the runtime said: {message}"
                        ),
                    )
                })?;
                Ok("CUDA device 0 (CubeCL)".to_string())
            }
            #[cfg(feature = "wgpu")]
            Device::Wgpu => {
                let device = Default::default();
                memsave::memory::wgpu::probe(&device).map_err(|message| {
                    memsave::Error::invalid(
                        "--device",
                        format!(
                            "wgpu is not usable here: no Vulkan, Metal or DX12 driver found \
                             an adapter. Install your GPU vendor's driver, or on Debian \
                             `apt-get install mesa-vulkan-drivers` for a software Vulkan device \
                             (lavapipe), or use `--device cpu`; the runtime said: {message}"
                        ),
                    )
                })?;
                Ok("wgpu default device (CubeCL)".to_string())
            }
            #[cfg(not(all(feature = "cuda", feature = "wgpu")))]
            other => Err(not_built(other)),
        }
    }
}

/// The error for a device whose feature this build lacks.
#[allow(dead_code)]
pub fn not_built(device: Device) -> memsave::Error {
    let (name, features) = match device {
        Device::Cpu => ("the CPU", "`--features default`"),
        Device::Cuda => ("CUDA", "`--features cuda`"),
        Device::Wgpu => ("wgpu", "`--features wgpu` (or `vulkan`, `metal`)"),
    };
    memsave::Error::invalid(
        "--device",
        format!("this memsave was built without {name}: rebuild with {features}"),
    )
}

/// Runs `$body` with `$inner` the inner backend of `$device` (Flex, Cuda, Wgpu): the one place
/// a command turns `--device` into a backend type.
#[macro_export]
macro_rules! on_backend {
    ($device:expr, $inner:ident => $body:expr) => {
        // A device whose runtime cannot start (no driver, no adapter) is the flag's error,
        // before anything is read or written, never a panic inside the runtime.
        match $device.describe() {
            Err(error) => Err(error.into()),
            Ok(_) => $crate::on_backend!(@unchecked $device, $inner => $body),
        }
    };
    (@unchecked $device:expr, $inner:ident => $body:expr) => {
        match $device {
            $crate::commands::Device::Cpu => {
                type $inner = burn::backend::Flex;
                $body
            }
            #[cfg(feature = "cuda")]
            $crate::commands::Device::Cuda => {
                type $inner = burn::backend::Cuda;
                $body
            }
            #[cfg(feature = "wgpu")]
            $crate::commands::Device::Wgpu => {
                type $inner = burn::backend::Wgpu;
                $body
            }
            #[allow(unreachable_patterns)]
            other => Err($crate::commands::not_built(other).into()),
        }
    };
}
