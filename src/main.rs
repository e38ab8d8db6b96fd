//! The `memsave` command line.

use clap::Parser;

/// GPU-memory savers for Burn training: mixed precision, gradient accumulation and gradient
/// checkpointing, switched on by one line of config.
#[derive(Parser, Debug)]
#[command(name = "memsave", version, about)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
    println!(
        "memsave {}: the library and its examples are ready \
         (`cargo run --release --example custom_model`); \
         the `train`, `bench` and `data` commands are not built yet.",
        env!("CARGO_PKG_VERSION")
    );
}
