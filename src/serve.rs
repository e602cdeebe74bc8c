//! `charm serve`: the OpenAI-compatible HTTP server for a model, on this machine or on a cluster.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use charm_coordinator::cluster::model_fingerprint;
use charm_coordinator::decode::template::ChatTemplate;
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::serve::{self, GatewayOptions};
use charm_shared::config::ModelSpec;
use charm_shared::quant::Activations;
use clap::Args;

use crate::common::{self, act_name, Act, DraftArgs, StoreArgs};

/// The flags of `charm serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on; beyond loopback an API key is required.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// File holding the API key clients must send as `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// The model's name in the API (default: the model directory's name; requests may name
    /// the model by either).
    #[arg(long)]
    pub name: Option<String>,
    /// Requests that may wait beyond the running ones (more get 429 with `Retry-After`). Large
    /// by default: a waiting request holds only its prompt, and clients such as
    /// lm-evaluation-harness send dozens at once and retry without reading `Retry-After`.
    #[arg(long, default_value_t = 256)]
    pub queue: usize,
    /// Generations running at once: one forward step serves them all (continuous batching).
    /// The memory plan reserves a context's KV for each.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Tokens one forward step takes at most: every running generation's next token, then
    /// chunks of prompts still being read.
    #[arg(long, default_value_t = 512)]
    pub batch_tokens: usize,
    /// MiB of finished conversations' KV kept for requests that continue them (0: none).
    #[arg(long, default_value_t = 256)]
    pub prefix_cache_mb: usize,
    /// Persist finished conversations' KV in this directory (an append-only log with
    /// checksums, safe across crashes): a restarted server continues them without prefilling
    /// them again.
    #[arg(long)]
    pub kv_dir: Option<PathBuf>,
    /// MiB the KV directory may hold before it keeps only the most recent conversations.
    #[arg(long, default_value_t = 4096)]
    pub kv_disk_mb: u64,
    /// Seconds a client has to send a request's headers (an idle keep-alive connection too),
    /// and again its body; past it the connection is closed.
    #[arg(long, default_value_t = 30.0)]
    pub read_timeout: f64,
    /// Connections open at once; more are closed as they arrive.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Do not feed the tokens a grammar forces (structured output) as drafts: sample every
    /// token in its own step (the same tokens, more steps).
    #[arg(long)]
    pub no_forced_drafts: bool,
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: Act,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// `charm serve`: the OpenAI-compatible gateway for `model` (on the cluster when `--cluster`).
pub fn serve(a: ServeArgs) -> Result<()> {
    let (model, listen, api_key_file) = (&a.model, a.listen.as_str(), a.api_key_file.as_deref());
    let (queue, parallel, batch_tokens, prefix_mb) =
        (a.queue, a.parallel, a.batch_tokens, a.prefix_cache_mb);
    let kv = a.kv_dir.map(|d| (d, a.kv_disk_mb << 20));
    let (name, act, args) = (a.name, Activations::from(a.activations), &a.store);
    let addr: std::net::SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(listen)
        .with_context(|| format!("--listen {listen}"))?
        .next()
        .with_context(|| format!("--listen {listen}: no address"))?;
    let api_key = match api_key_file {
        Some(f) => {
            let k = std::fs::read_to_string(f)
                .with_context(|| format!("--api-key-file {}", f.display()))?;
            let k = k.trim().to_string();
            if k.len() < 16 {
                bail!(
                    "--api-key-file {}: the key must be at least 16 characters",
                    f.display()
                );
            }
            Some(k)
        }
        None => None,
    };
    if !addr.ip().is_loopback() && api_key.is_none() {
        bail!("{addr} is reachable from other machines: give --api-key-file or listen on loopback");
    }
    let spec = ModelSpec::from_dir(model)?;
    let context = args
        .ctx
        .unwrap_or_else(|| spec.max_position_embeddings.clamp(1, 4096));
    // the memory plan holds the KV of every generation that may run at once
    let e = common::load(model, args, context * parallel.max(1), act)?;
    let tok = TextTokenizer::load(model)?;
    let template = ChatTemplate::from_dir(model)?;
    if template.is_none() {
        eprintln!(
            "warning: {} has no chat template: /v1/chat/completions answers 400",
            model.display()
        );
    }
    let dir_name = model
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "charm".into());
    let opts = GatewayOptions {
        model_name: name.unwrap_or_else(|| dir_name.clone()),
        model_aliases: vec![dir_name],
        api_key,
        queue: queue.max(1),
        max_active: parallel.max(1),
        batch_tokens: batch_tokens.max(1),
        prefix_cache_bytes: prefix_mb << 20,
        stop_ids: serve::stop_token_ids(model, &spec),
        tokenizer_config: serve::tokenizer_config(model),
        context,
        kv_log: match kv {
            Some((dir, budget)) => Some(serve::KvLogOptions {
                dir,
                budget,
                fingerprint: format!(
                    "{} activations={}",
                    model_fingerprint(model).map_err(anyhow::Error::msg)?,
                    act_name(act)
                ),
            }),
            None => None,
        },
        draft: a.draft.options(args.cluster.is_some()),
        forced_drafts: !a.no_forced_drafts,
        connections: serve::ConnectionLimits {
            read_timeout: std::time::Duration::try_from_secs_f64(a.read_timeout)
                .ok()
                .filter(|d| !d.is_zero())
                .with_context(|| {
                    format!(
                        "--read-timeout {}: a positive number of seconds",
                        a.read_timeout
                    )
                })?,
            max_connections: a.max_connections.max(1),
        },
        ..Default::default()
    };
    raise_descriptor_limit(a.max_connections);
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(serve::serve(e, tok, template, addr, opts, |a| {
        // one write, errors ignored: a reader may close the pipe after the first line
        let mut out = std::io::stdout();
        let _ = out.write_all(
            format!("listening on {a}\nchat page and dashboard: http://{a}/\n").as_bytes(),
        );
        let _ = out.flush();
    }))
    .map_err(anyhow::Error::msg)
}

/// Raises the soft limit on open files toward the hard one, so that `--max-connections` (plus
/// the model's files and sockets) fits; says so when it cannot.
fn raise_descriptor_limit(connections: usize) {
    let want = connections as u64 + 256;
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid rlimit for getrlimit/setrlimit to read and write.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 || r.rlim_cur >= want {
            return;
        }
        r.rlim_cur = want.min(r.rlim_max);
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        if r.rlim_cur < want {
            eprintln!(
                "warning: open files are limited to {}: --max-connections {connections} may not fit",
                r.rlim_cur
            );
        }
    }
}
