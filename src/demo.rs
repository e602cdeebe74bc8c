//! `charm demo`: the bundled example model end to end, on a loopback cluster (or single-box), and
//! optionally served over the OpenAI-compatible API.

use std::path::Path;

use anyhow::{bail, Context, Result};
use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::{ForwardOptions, Model};
use clap::Args;

/// The flags of `charm demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// One process, routed experts in RAM, no workers.
    #[arg(long)]
    pub single_box: bool,
    /// Then serve the OpenAI-compatible API on `--listen` until interrupted, printing a
    /// `curl` line that works.
    #[arg(long)]
    pub serve: bool,
    #[arg(long, default_value = "127.0.0.1:8080", requires = "serve")]
    pub listen: String,
}

/// `charm demo`: a coordinator and two loopback workers (or one process with `--single-box`)
/// generate from the demo model; with workers, the same request single-box must give the same
/// tokens. With `--serve`, then serves the API on `--listen` until interrupted.
pub fn demo(a: &DemoArgs) -> Result<()> {
    let (single_box, serve) = (a.single_box, a.serve.then_some(a.listen.as_str()));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bard = root.join("models/charm-bard-moe");
    if !bard.join("model.safetensors").is_file() {
        bail!(
            "{} is missing: the demo model ships in the repository",
            bard.display()
        );
    }
    println!("charm demo: charm-bard-moe, a GLM-5.2-architecture MoE (MLA, DSA sparse attention, 32 experts top-4 + 1 shared, MTP head) trained on Shakespeare");
    let t = std::time::Instant::now();
    let plain = charm_coordinator::EngineOptions {
        history: charm_coordinator::HistoryPolicy::Off,
        ..Default::default()
    };
    // a coordinator and two expert workers on this machine, as on three
    let lb = if single_box {
        None
    } else {
        let exe = std::env::current_exe()?;
        match charm_coordinator::cluster::Loopback::start(&exe, &bard, 2, "f32", &[]) {
            Ok(lb) => Some(lb),
            Err(e) => {
                eprintln!("warning: loopback workers did not start ({e:#}); running single-box");
                None
            }
        }
    };
    let opts = charm_coordinator::EngineOptions {
        cluster: lb.as_ref().map(|l| l.options()),
        ..plain.clone()
    };
    let e = charm_coordinator::Engine::load(&bard, &opts)
        .with_context(|| format!("loading {}", bard.display()))?;
    for w in &e.warnings {
        eprintln!("warning: {w}");
    }
    match &lb {
        Some(lb) => println!(
            "mode: loopback cluster: this process holds the dense skeleton and the router; {} worker processes ({}) compute the routed experts and answer over QUIC with mutual TLS (certificates in {}); this process keeps the experts too, to fall back on",
            lb.workers.len(),
            lb.workers
                .iter()
                .map(|w| format!("{} at {}", w.name, w.addr))
                .collect::<Vec<_>>()
                .join(", "),
            lb.dir.display()
        ),
        None => println!("mode: single box, routed experts in RAM"),
    }
    let m = &e.model;
    let tok = TextTokenizer::load(&bard)?;
    println!(
        "loaded in {:.2}s: {} layers, {} routed experts per MoE layer",
        t.elapsed().as_secs_f64(),
        m.spec.layers.len(),
        m.spec.router.as_ref().map_or(0, |r| r.n_experts)
    );
    let prompt = "ROMEO. ";
    let ids = tok.encode(prompt)?;
    let sp = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
        ..Default::default()
    };
    let run = |m: &Model| {
        generate(
            m,
            &ids,
            120,
            &mut Sampler::new(sp),
            &m.spec.eos_token_ids,
            ForwardOptions::default(),
        )
    };
    let g = run(m)?;
    println!("--- prompt: {prompt:?} (temperature 0.8, top-p 0.95, seed 7)");
    println!("{prompt}{}", tok.decode(&g.ids)?);
    println!("---");
    println!(
        "prefill {} tokens at {:.1} tok/s, decoded {} tokens at {:.1} tok/s ({})",
        g.prompt_tokens,
        g.prefill_tok_s(),
        g.ids.len(),
        g.decode_tok_s(),
        g.finish_reason
    );
    if let Some(r) = &e.remote {
        for w in r.status() {
            println!(
                "  {}: {} expert requests, {:.1} KB moved, mean round trip {:.2} ms{}",
                w.name,
                w.requests,
                (w.bytes_sent + w.bytes_received) as f64 / 1e3,
                w.mean_rtt_ms,
                if w.connected { "" } else { " (lost)" }
            );
        }
        let alone = charm_coordinator::Engine::load(&bard, &plain)?;
        let same = run(&alone.model)?.ids == g.ids;
        println!(
            "single-box run of the same request: {}",
            if same {
                "the same tokens"
            } else {
                "DIFFERENT tokens"
            }
        );
        if !same {
            bail!("the cluster changed the output");
        }
    }
    if let Some(listen) = serve {
        let addr: std::net::SocketAddr = listen
            .parse()
            .with_context(|| format!("--listen {listen}"))?;
        let template = charm_coordinator::decode::template::ChatTemplate::from_dir(&bard)?;
        let opts = charm_coordinator::serve::GatewayOptions {
            model_name: "charm-bard-moe".into(),
            context: e.model.spec.max_position_embeddings.clamp(1, 4096),
            stop_ids: charm_coordinator::serve::stop_token_ids(&bard, &e.model.spec),
            tokenizer_config: charm_coordinator::serve::tokenizer_config(&bard),
            ..Default::default()
        };
        let rt = tokio::runtime::Runtime::new()?;
        // Ctrl-C or SIGTERM ends the server normally, so the workers are stopped and the key
        // directory removed (by `lb`'s drop) rather than left on disk
        stop_on_signals();
        let served = rt.block_on(async {
            tokio::select! {
                r = serve_demo(e, tok, template, addr, opts) => r,
                () = signalled() => Ok(()),
            }
        });
        drop(lb);
        served.map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// Set by the first SIGINT or SIGTERM.
static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // a second signal ends the process at once (as the default action would)
    if STOP.swap(true, std::sync::atomic::Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

/// Routes SIGINT and SIGTERM to [`STOP`].
fn stop_on_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only touches an atomic and calls `_exit`, both async-signal-safe.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// Resolves once a signal set [`STOP`] (checked ten times a second).
async fn signalled() {
    while !STOP.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The demo model served until the process ends, with the `curl` line printed once it listens.
async fn serve_demo(
    e: charm_coordinator::Engine,
    tok: TextTokenizer,
    template: Option<charm_coordinator::decode::template::ChatTemplate>,
    addr: std::net::SocketAddr,
    opts: charm_coordinator::serve::GatewayOptions,
) -> Result<(), String> {
    charm_coordinator::serve::serve(
        e,
        tok,
        template,
        addr,
        opts,
        |a| {
            // one write, errors ignored: whoever reads may close the pipe after a line
            use std::io::Write;
            let _ = std::io::stdout().write_all(
                format!(
                    "serving the OpenAI-compatible API on http://{a} (Ctrl-C stops)\n\
                     chat page and dashboard: http://{a}/ (open it in a browser)\n\
                     or try:\n\
                     curl http://{a}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Speak, Romeo.\"}}], \"max_tokens\": 60}}'\n"
                )
                .as_bytes(),
            );
            let _ = std::io::stdout().flush();
        },
    )
    .await
}
