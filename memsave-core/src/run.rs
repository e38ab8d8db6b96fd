//! One run, one context: memsave-common's [`RunContext`] (`memsave_common::run`), re-exported
//! here. Both runtimes share it, so a run on Burn 0.21 and one on Burn 0.22 installed on the same
//! thread are the same run.

pub use memsave_common::run::*;
