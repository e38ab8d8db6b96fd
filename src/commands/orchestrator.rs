//! `memsave orchestrator --port P`: burn-collective's global orchestrator, which the nodes of a
//! multi-machine run (`memsave train --nodes M --node-rank R --orchestrator ws://HOST:P`)
//! register with.

#[derive(clap::Args, Debug)]
pub struct OrchestratorArgs {
    /// The port to listen on (all interfaces).
    #[arg(long)]
    pub port: u16,
}

pub fn orchestrator(args: OrchestratorArgs) -> memsave::Result<()> {
    eprintln!(
        "memsave: orchestrator on port {} (nodes: --orchestrator ws://THIS_HOST:{}); Ctrl-C \
         ends it",
        args.port, args.port
    );
    memsave::parallel::serve_orchestrator(args.port)
}
