//! The TOML configuration (memsave-common's [`Config`], with MMCV's section and switch names)
//! and the runner's hooks it makes on Burn 0.21 ([`ConfigHooks`]).

mod hooks;

pub use hooks::ConfigHooks;
pub use memsave_common::config::*;
