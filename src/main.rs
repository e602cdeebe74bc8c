//! The `charm` command line.
//!
//! Contract spellings (used by outside checks; keep them):
//! `charm logits --model DIR --ids 5,17,3 --out FILE.safetensors`,
//! `charm generate --model DIR --ids 5,17,3 --max-tokens N --temperature 0 --json`,
//! `charm info --model DIR`.
//!
//! Each command group has its own module, holding its flags and its handler: `run` (logits,
//! generate), `chat`, `model_tools` (convert, quality, evaluate), `inspect` (plan, doctor, info,
//! synth, iobench), `cluster` (cluster init/status, worker), `serve`, `demo`. What several of them
//! use is in `common`; they depend on it and never on each other.

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

mod chat;
mod cluster;
mod common;
mod demo;
mod inspect;
mod model_tools;
mod run;
mod serve;

#[derive(Parser, Debug)]
#[command(
    name = "charm",
    version,
    about = "Runs Mixture-of-Experts language models on home-lab machines"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// One teacher-forced pass without cache; writes tensor `logits` [S, vocab] f32.
    Logits(run::LogitsArgs),
    /// Decodes through the KV cache.
    Generate(run::GenerateArgs),
    /// Architecture, parameter counts (dense vs routed experts), bytes per dtype, active bytes per token.
    Info(inspect::InfoArgs),
    /// Converts a Hugging Face checkpoint into a charm container (resumable).
    Convert(model_tools::ConvertArgs),
    /// Top-1 agreement and KL divergence of a model's teacher-forced logits against a reference
    /// file holding `tf_input_ids` and `tf_logits` (the oracle fixtures' and the demo model's).
    Quality(model_tools::QualityArgs),
    /// Held-out perplexity, top-1 accuracy, MTP draft acceptance and routing skew over a text or
    /// a token-id file (a safetensors file with tensor `ids`).
    Evaluate(model_tools::EvaluateArgs),
    /// Runs the bundled example model end to end: a coordinator and two expert workers on
    /// loopback, then the same request single-box to show the tokens agree.
    Demo(demo::DemoArgs),
    /// Single-box memory plan from metadata only: resident bytes, expert cache, expected disk
    /// traffic per token, predicted bottleneck. MODEL is a charm container, or a Hugging Face
    /// checkpoint planned as `charm convert` would store it (only its headers are read). Exit 1
    /// when it does not fit.
    Plan(inspect::PlanArgs),
    /// Readiness checks (files, headers, checksums with --deep, RAM, O_DIRECT, read speed).
    /// Exit 0 when runnable (warnings allowed), 1 when not, 2 on bad usage.
    Doctor(inspect::DoctorArgs),
    /// Writes a deterministic synthetic container with GLM-5.2's layer shapes (random weights,
    /// Zipf-skewed expert popularity), for measuring streaming on models larger than RAM.
    Synth(inspect::SynthArgs),
    /// Disk read bandwidth for random aligned reads of expert-record size, O_DIRECT.
    Iobench(inspect::IoBenchArgs),
    /// Serves routed experts to a cluster's coordinator over QUIC with mutual TLS.
    Worker(cluster::WorkerArgs),
    /// OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions
    /// (streaming with `"stream": true`), /v1/messages, /health, /metrics, /v1/status, and a
    /// chat page and dashboard at /. Prints `listening on ADDR`, then the page's URL.
    Serve(serve::ServeArgs),
    /// A conversation in the terminal with a model (--model) or a running server (--url):
    /// answers stream as they are generated, then a line of speed. `/reset` forgets the
    /// conversation, `/quit` leaves.
    Chat(chat::ChatArgs),
    /// Cluster set-up and health.
    Cluster {
        #[command(subcommand)]
        cmd: cluster::ClusterCmd,
    },
}

fn main() -> ExitCode {
    // before any other thread exists
    charm_coordinator::tune_allocator();
    let cli = Cli::parse();
    // structured logs on stderr (`RUST_LOG` filters; default: charm's own at info)
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("charm_coordinator=info")),
        )
        .try_init();
    if let Some(n) = cli.cmd.store().and_then(|s| s.threads) {
        // the forward pass's own pool (charm_shared::par) follows the same count (`--threads`
        // parses as at least one)
        charm_shared::par::set_threads(n);
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
        if let Err(e) = built {
            eprintln!("error: --threads: {e}");
            return ExitCode::FAILURE;
        }
    }
    // Run on a rayon worker: kernels called from inside the pool split work without a futex
    // hand-off per call (which costs more than a small matmul). Not a worker or a server: they
    // wait on the network for their whole life and compute from other threads, so they would
    // hold a pool thread idle.
    let r = if matches!(
        cli.cmd,
        Cmd::Worker(_) | Cmd::Serve(_) | Cmd::Demo(demo::DemoArgs { serve: true, .. })
    ) {
        dispatch(cli)
    } else {
        rayon::scope(|_| dispatch(cli))
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

impl Cmd {
    /// The command's store flags, where it has them (`--threads` among them).
    fn store(&self) -> Option<&common::StoreArgs> {
        match self {
            Cmd::Logits(a) => Some(&a.store),
            Cmd::Generate(a) => Some(&a.store),
            Cmd::Quality(a) => Some(&a.store),
            Cmd::Evaluate(a) => Some(&a.store),
            Cmd::Plan(a) => Some(&a.store),
            Cmd::Doctor(a) => Some(&a.store),
            Cmd::Worker(a) => Some(&a.store),
            Cmd::Serve(a) => Some(&a.store),
            Cmd::Chat(a) => Some(&a.store),
            Cmd::Cluster {
                cmd: cluster::ClusterCmd::Status { store, .. },
            } => Some(store),
            _ => None,
        }
    }
}

/// Runs the command's handler.
fn dispatch(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Logits(a) => run::logits(&a),
        Cmd::Generate(a) => run::generate(&a),
        Cmd::Info(a) => inspect::info(&a),
        Cmd::Convert(a) => model_tools::convert(&a),
        Cmd::Quality(a) => model_tools::quality(&a),
        Cmd::Evaluate(a) => model_tools::evaluate(&a),
        Cmd::Demo(a) => demo::demo(&a),
        Cmd::Plan(a) => inspect::plan(&a),
        Cmd::Doctor(a) => inspect::doctor(&a),
        Cmd::Synth(a) => inspect::synth(&a),
        Cmd::Iobench(a) => inspect::iobench(&a),
        Cmd::Worker(a) => cluster::worker(&a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Chat(a) => chat::chat(a),
        Cmd::Cluster { cmd } => cluster::cluster(&cmd),
    }
}
