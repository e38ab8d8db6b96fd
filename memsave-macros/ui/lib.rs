//! Nothing: this crate holds the compile-fail cases of memsave's macros (`tests/ui.rs`).
