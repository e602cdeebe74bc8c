//! The `charm` command line.
//!
//! Contract spellings (used by outside checks; keep them):
//! `charm logits --model DIR --ids 5,17,3 --out FILE.safetensors`,
//! `charm generate --model DIR --ids 5,17,3 --max-tokens N --temperature 0 --json`,
//! `charm info --model DIR`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use charm_coordinator::cache::KvCache;
use charm_coordinator::convert::convert;
use charm_coordinator::engine::render_stats;
use charm_coordinator::generate::generate;
use charm_coordinator::info::ModelInfo;
use charm_coordinator::plan::human;
use charm_coordinator::sampling::{Sampler, SamplingParams};
use charm_coordinator::tokenizer::TextTokenizer;
use charm_coordinator::{ForwardOptions, MlaMode, Model};
use charm_shared::container::{Policy, StoreFormat};
use charm_shared::quant::Activations;
use clap::{Parser, Subcommand, ValueEnum};
use single_box::StoreArgs;

mod chat_cli;
mod cluster_cli;
mod single_box;

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

#[derive(Copy, Clone, Debug, ValueEnum)]
enum Mla {
    Naive,
    Absorbed,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum Act {
    F32,
    Int8,
}

impl From<Act> for Activations {
    fn from(a: Act) -> Self {
        match a {
            Act::F32 => Activations::F32,
            Act::Int8 => Activations::Int8,
        }
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// One teacher-forced pass without cache; writes tensor `logits` [S, vocab] f32.
    Logits {
        #[arg(long)]
        model: PathBuf,
        /// Comma-separated token ids.
        #[arg(long)]
        ids: String,
        #[arg(long)]
        out: PathBuf,
        /// MLA evaluation: naive expansion or weight absorption.
        #[arg(long, value_enum, default_value = "naive")]
        mla: Mla,
        #[arg(long, value_enum, default_value = "f32")]
        activations: Act,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Decodes through the KV cache.
    Generate {
        #[arg(long)]
        model: PathBuf,
        /// Comma-separated prompt token ids.
        #[arg(long, required_unless_present = "prompt", conflicts_with = "prompt")]
        ids: Option<String>,
        /// Prompt text, tokenized with the model's tokenizer.json; the output is printed as text.
        #[arg(long)]
        prompt: Option<String>,
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// 0 = greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stop at the model's end-of-sequence tokens.
        #[arg(long)]
        stop_at_eos: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        #[arg(long, value_enum, default_value = "absorbed")]
        mla: Mla,
        /// Activations against quantized weights: f32 (exact product of the stored weights) or
        /// int8 (integer dot products: faster, adds activation rounding; see docs/quality.md).
        #[arg(long, value_enum, default_value = "f32")]
        activations: Act,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Architecture, parameter counts (dense vs routed experts), bytes per dtype, active bytes per token.
    Info {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Converts a Hugging Face checkpoint into a charm container (resumable).
    Convert {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        formats: FormatArgs,
    },
    /// Top-1 agreement and KL divergence of a model's teacher-forced logits against a reference
    /// file holding `tf_input_ids` and `tf_logits` (the oracle fixtures' and the demo model's).
    Quality {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        reference: PathBuf,
        #[arg(long, value_enum, default_value = "f32")]
        activations: Act,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Held-out perplexity, top-1 accuracy, MTP draft acceptance and routing skew over a text or
    /// a token-id file (a safetensors file with tensor `ids`).
    Evaluate {
        #[arg(long)]
        model: PathBuf,
        #[arg(
            long,
            conflicts_with = "text_file",
            required_unless_present = "text_file"
        )]
        ids_file: Option<PathBuf>,
        #[arg(long)]
        text_file: Option<PathBuf>,
        /// Tokens predicted per window (each window is scored without cache from the previous).
        #[arg(long, default_value_t = 256)]
        window: usize,
        #[arg(long, default_value_t = 64)]
        max_windows: usize,
        #[arg(long, value_enum, default_value = "f32")]
        activations: Act,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Runs the bundled example model end to end: a coordinator and two expert workers on
    /// loopback, then the same request single-box to show the tokens agree.
    Demo {
        /// One process, routed experts in RAM, no workers.
        #[arg(long)]
        single_box: bool,
        /// Then serve the OpenAI-compatible API on `--listen` until interrupted, printing a
        /// `curl` line that works.
        #[arg(long)]
        serve: bool,
        #[arg(long, default_value = "127.0.0.1:8080", requires = "serve")]
        listen: String,
    },
    /// Single-box memory plan from metadata only: resident bytes, expert cache, expected disk
    /// traffic per token, predicted bottleneck. MODEL is a charm container, or a Hugging Face
    /// checkpoint planned as `charm convert` would store it (only its headers are read). Exit 1
    /// when it does not fit.
    Plan {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
        /// Storage formats assumed for a checkpoint (a container has its own).
        #[command(flatten, next_help_heading = "Formats assumed for a checkpoint")]
        formats: FormatArgs,
    },
    /// Readiness checks (files, headers, checksums with --deep, RAM, O_DIRECT, read speed).
    /// Exit 0 when runnable (warnings allowed), 1 when not, 2 on bad usage.
    Doctor {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        json: bool,
        /// Verify every checksum (reads the whole model) and measure the disk longer.
        #[arg(long)]
        deep: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Writes a deterministic synthetic container with GLM-5.2's layer shapes (random weights,
    /// Zipf-skewed expert popularity), for measuring streaming on models larger than RAM.
    Synth {
        #[arg(long)]
        out: PathBuf,
        /// glm-5.2 (hidden 6144, 256 experts of width 2048, top-8), yardstick (the shapes of
        /// ../shared/bench/make_bench_model.py with --layers 6 --dense-layers 2) or tiny (test-sized).
        #[arg(long, default_value = "glm-5.2")]
        preset: String,
        /// MoE layers.
        #[arg(long, default_value_t = 4)]
        layers: usize,
        /// Dense layers before them.
        #[arg(long, default_value_t = 1)]
        dense_layers: usize,
        /// Vocabulary size (default: the preset's, 154880 for glm-5.2).
        #[arg(long)]
        vocab: Option<usize>,
        /// Skew of expert popularity (0: uniform; larger: a smaller hot set).
        #[arg(long, default_value_t = 1.0)]
        skew: f64,
        #[arg(long, default_value = "int4")]
        experts: String,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Override the preset's hidden size.
        #[arg(long)]
        hidden: Option<usize>,
        /// Override the routed-expert width.
        #[arg(long)]
        moe_intermediate: Option<usize>,
        /// Override the routed experts per layer.
        #[arg(long)]
        n_experts: Option<usize>,
        /// Override the experts per token.
        #[arg(long)]
        top_k: Option<usize>,
    },
    /// Disk read bandwidth for random aligned reads of expert-record size, O_DIRECT.
    Iobench(single_box::IoBenchArgs),
    /// Serves routed experts to a cluster's coordinator over QUIC with mutual TLS.
    Worker {
        /// Address to listen on (UDP), e.g. 0.0.0.0:7070 (port 0: any free port).
        #[arg(long)]
        listen: String,
        #[arg(long)]
        model: PathBuf,
        /// This worker's node name: its certificate in the cluster directory.
        #[arg(long)]
        node: String,
        /// Activation mode it computes in (the coordinator's must match).
        #[arg(long, value_enum, default_value = "f32")]
        activations: Act,
        /// Compute threads (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// MODEL may lack expert records (a directory with only `config.json` and `charm.json`
        /// will do): the worker fetches those of the experts placed on it from the coordinator,
        /// checksummed, resuming after a restart (journal `shard.log` in MODEL).
        #[arg(long)]
        fetch_shard: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions
    /// (streaming with `"stream": true`), /health, /metrics. Prints `listening on ADDR`.
    Serve {
        #[arg(long)]
        model: PathBuf,
        /// Address to listen on; beyond loopback an API key is required.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// File holding the API key clients must send as `Authorization: Bearer KEY`.
        #[arg(long)]
        api_key_file: Option<PathBuf>,
        /// The model's name in the API (default: the model directory's name).
        #[arg(long)]
        name: Option<String>,
        /// Requests that may wait beyond the running ones (more get 429).
        #[arg(long, default_value_t = 16)]
        queue: usize,
        /// Generations running at once: one forward step serves them all (continuous batching).
        /// The memory plan reserves a context's KV for each.
        #[arg(long, default_value_t = 4)]
        parallel: usize,
        /// Tokens one forward step takes at most: every running generation's next token, then
        /// chunks of prompts still being read.
        #[arg(long, default_value_t = 512)]
        batch_tokens: usize,
        /// MiB of finished conversations' KV kept for requests that continue them (0: none).
        #[arg(long, default_value_t = 256)]
        prefix_cache_mb: usize,
        /// Persist finished conversations' KV in this directory (an append-only log with
        /// checksums, safe across crashes): a restarted server continues them without prefilling
        /// them again.
        #[arg(long)]
        kv_dir: Option<PathBuf>,
        /// MiB the KV directory may hold before it keeps only the most recent conversations.
        #[arg(long, default_value_t = 4096)]
        kv_disk_mb: u64,
        #[arg(long, value_enum, default_value = "f32")]
        activations: Act,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// A conversation in the terminal with a model (--model) or a running server (--url):
    /// answers stream as they are generated, then a line of speed. `/reset` forgets the
    /// conversation, `/quit` leaves.
    Chat {
        #[arg(long, required_unless_present = "url", conflicts_with = "url")]
        model: Option<PathBuf>,
        /// An OpenAI-compatible server, e.g. http://127.0.0.1:8080.
        #[arg(long)]
        url: Option<String>,
        /// File holding the server's API key.
        #[arg(long, requires = "url")]
        api_key_file: Option<PathBuf>,
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        /// 0 = greedy.
        #[arg(long, default_value_t = 0.8)]
        temperature: f32,
        #[arg(long, default_value_t = 0.95)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, value_enum, default_value = "f32")]
        activations: Act,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Cluster set-up and health.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// Makes a cluster authority and a certificate and key per node (keys 0600).
    Init {
        #[arg(long)]
        out: PathBuf,
        /// Node names, comma-separated (`coordinator` is always added).
        #[arg(long)]
        nodes: String,
    },
    /// Dials every worker of the cluster: health, experts placed, RAM, latency. Exit 1 when
    /// none answers.
    Status {
        /// The model the cluster serves (its fingerprint is checked by every worker).
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
}

fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids: Vec<u32> = s
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .with_context(|| format!("`{t}` is not a token id"))
        })
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("--ids is empty");
    }
    Ok(ids)
}

fn opts(m: Mla) -> ForwardOptions {
    ForwardOptions {
        mla: match m {
            Mla::Naive => MlaMode::Naive,
            Mla::Absorbed => MlaMode::Absorbed,
        },
    }
}

fn cmd_logits(
    model: &Path,
    ids: &str,
    out: &Path,
    mla: Mla,
    act: Activations,
    store: &StoreArgs,
) -> Result<()> {
    let ids = parse_ids(ids)?;
    let e = single_box::load(model, store, ids.len(), act)?;
    let m = &e.model;
    let mut cache = KvCache::new(&m.spec);
    let normed = m.forward(&ids, &mut cache, opts(mla), None)?;
    let logits = m.logits(&normed, ids.len())?;
    charm_shared::safetensors::write_f32(
        out,
        &[("logits", vec![ids.len(), m.spec.vocab_size], &logits)],
    )
    .with_context(|| format!("writing {}", out.display()))?;
    single_box::finish(&e, store)?;
    eprintln!(
        "wrote logits [{}, {}] to {}",
        ids.len(),
        m.spec.vocab_size,
        out.display()
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn cmd_generate(
    model: &Path,
    ids: Option<&str>,
    text: Option<&str>,
    max_tokens: usize,
    sp: SamplingParams,
    stop_at_eos: bool,
    json: bool,
    mla: Mla,
    act: Activations,
    store: &StoreArgs,
) -> Result<()> {
    let tok = match text {
        Some(_) => Some(TextTokenizer::load(model)?),
        None => None,
    };
    let prompt = match (ids, text, &tok) {
        (Some(ids), _, _) => parse_ids(ids)?,
        (None, Some(t), Some(tok)) => tok.encode(t)?,
        _ => bail!("give --ids or --prompt"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if !(sp.temperature >= 0.0 && sp.temperature.is_finite()) {
        bail!("--temperature must be >= 0");
    }
    if !(sp.top_p > 0.0 && sp.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1]");
    }
    let t = std::time::Instant::now();
    let e = single_box::load(model, store, prompt.len() + max_tokens, act)?;
    let m = &e.model;
    let load_s = t.elapsed().as_secs_f64();
    let before = e.stats();
    let stops = if stop_at_eos {
        m.spec.eos_token_ids.clone()
    } else {
        Vec::new()
    };
    let g = generate(
        m,
        &prompt,
        max_tokens,
        &mut Sampler::new(sp),
        &stops,
        opts(mla),
    )?;
    single_box::finish(&e, store)?;
    let run = e
        .stats()
        .map(|s| before.as_ref().map_or(s.clone(), |b| s.since(b)));
    if json {
        let mut v = serde_json::json!({
            "ids": g.ids,
            "prompt_tokens": g.prompt_tokens,
            "finish_reason": g.finish_reason,
            "load_seconds": load_s,
            "prefill_seconds": g.prefill_seconds,
            "prefill_tok_s": g.prefill_tok_s(),
            "decode_seconds": g.decode_seconds,
            "decode_tok_s": g.decode_tok_s(),
            "isa": format!("{:?}", charm_shared::quant::active_isa()),
        });
        if let Some(tok) = &tok {
            v["text"] = tok.decode(&g.ids)?.into();
        }
        v["stats"] = e.run_stats(run.as_ref());
        println!("{v}");
    } else {
        match &tok {
            Some(tok) => println!("{}{}", text.unwrap_or(""), tok.decode(&g.ids)?),
            None => println!(
                "{}",
                g.ids
                    .iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
        eprintln!(
            "prefill {} tokens in {:.3}s ({:.1} tok/s), decode {} tokens in {:.3}s ({:.1} tok/s), finish: {}",
            g.prompt_tokens, g.prefill_seconds, g.prefill_tok_s(), g.ids.len(), g.decode_seconds, g.decode_tok_s(), g.finish_reason
        );
        eprintln!("{}", render_stats(run.as_ref()));
    }
    Ok(())
}

fn cmd_info(model: &Path, json: bool) -> Result<()> {
    let info = ModelInfo::read(model).with_context(|| format!("reading {}", model.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&info.to_json())?);
    } else {
        print!("{}", info.render());
    }
    Ok(())
}

fn store_format(flag: &str, v: &str, allowed: &[&str]) -> Result<StoreFormat> {
    match StoreFormat::parse(v) {
        Some(f) if allowed.contains(&v) => Ok(f),
        _ => bail!("--{flag} {v}: expected one of {}", allowed.join(", ")),
    }
}

/// Storage formats of a conversion (`charm convert`, and `charm plan` of a checkpoint).
#[derive(clap::Args, Debug, Clone)]
struct FormatArgs {
    /// Routed experts.
    #[arg(long, default_value = "int4")]
    experts: String,
    /// Attention, shared experts, dense MLPs.
    #[arg(long, default_value = "int8")]
    dense: String,
    /// Embedding and output head (per-row scales).
    #[arg(long, default_value = "int8")]
    embedding: String,
    /// The MTP layer (at int4 its draft acceptance collapses).
    #[arg(long, default_value = "int8")]
    mtp: String,
    /// Weights per scale in grouped formats.
    #[arg(long, default_value_t = 64)]
    group: usize,
}

impl FormatArgs {
    fn policy(&self) -> Result<Policy> {
        let q = ["int8", "int4", "int2", "bf16"];
        let policy = Policy {
            experts: store_format("experts", &self.experts, &q)?,
            dense: store_format("dense", &self.dense, &q)?,
            embedding: store_format("embedding", &self.embedding, &q)?,
            mtp: store_format("mtp", &self.mtp, &q)?,
            group: self.group,
        };
        charm_coordinator::convert::check_policy(&policy)?;
        Ok(policy)
    }
}

fn cmd_convert(model: &Path, out: &Path, policy: &Policy) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}")
            .expect("valid template"),
    );
    let abort_after = std::env::var("CHARM_CONVERT_ABORT_AFTER_BYTES")
        .ok()
        .and_then(|v| v.parse().ok());
    let t = std::time::Instant::now();
    let r = convert(model, out, policy, abort_after, &mut |done, total, what| {
        bar.set_length(total);
        bar.set_position(done);
        bar.set_message(what.to_string());
    })?;
    bar.finish_and_clear();
    eprintln!(
        "converted {} -> {}: {} in {:.1}s ({} units written, {} reused from an earlier run)",
        model.display(),
        out.display(),
        human(r.output_bytes),
        t.elapsed().as_secs_f64(),
        r.units_written,
        r.units_reused
    );
    Ok(())
}

fn cmd_quality(
    model: &Path,
    reference: &Path,
    json: bool,
    act: Activations,
    store: &StoreArgs,
) -> Result<()> {
    let r = charm_shared::safetensors::SafetensorsFile::open(reference)?;
    let ids = token_ids(&r, "tf_input_ids").context("reading the reference")?;
    let li = r
        .header
        .tensors
        .get("tf_logits")
        .context("reference has no `tf_logits`")?;
    let want = charm_shared::dtype::to_f32(li.dtype, r.bytes("tf_logits").expect("present"))
        .context("tf_logits is not a float tensor")?;
    let e = single_box::load(model, store, ids.len(), act)?;
    let m = &e.model;
    if want.len() != ids.len() * m.spec.vocab_size {
        bail!(
            "tf_logits holds {} values, expected {} x {}",
            want.len(),
            ids.len(),
            m.spec.vocab_size
        );
    }
    let mut cache = KvCache::new(&m.spec);
    let normed = m.forward(&ids, &mut cache, ForwardOptions::default(), None)?;
    let got = m.logits(&normed, ids.len())?;
    single_box::finish(&e, store)?;
    let a = charm_coordinator::quality::compare(&got, &want, m.spec.vocab_size);
    if json {
        println!(
            "{}",
            serde_json::json!({"positions": a.positions, "top1": a.top1, "mean_kl": a.mean_kl, "max_kl": a.max_kl})
        );
    } else {
        println!(
            "{} positions: top-1 agreement {:.1}%, mean KL {:.3e} nats, max KL {:.3e}",
            a.positions,
            100.0 * a.top1,
            a.mean_kl,
            a.max_kl
        );
    }
    Ok(())
}

fn read_ids_file(p: &Path) -> Result<Vec<u32>> {
    let f = charm_shared::safetensors::SafetensorsFile::open(p)?;
    token_ids(&f, "ids").with_context(|| format!("reading {}", p.display()))
}

/// Integer tensor `name` of `f` as token ids (refusing negative or too large values).
fn token_ids(f: &charm_shared::safetensors::SafetensorsFile, name: &str) -> Result<Vec<u32>> {
    f.ints(name)
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .map(|v| u32::try_from(v).with_context(|| format!("`{name}` holds {v}, not a token id")))
        .collect()
}

fn cmd_evaluate(
    model: &Path,
    ids_file: Option<&Path>,
    text_file: Option<&Path>,
    window: usize,
    max_windows: usize,
    json: bool,
    act: Activations,
    store: &StoreArgs,
) -> Result<()> {
    if window < 2 {
        bail!("--window must be at least 2");
    }
    let ids = match (ids_file, text_file) {
        (Some(p), _) => read_ids_file(p)?,
        (None, Some(t)) => TextTokenizer::load(model)?.encode(
            &std::fs::read_to_string(t).with_context(|| format!("reading {}", t.display()))?,
        )?,
        _ => bail!("give --ids-file or --text-file"),
    };
    let engine = single_box::load(model, store, window + 1, act)?;
    let e = charm_coordinator::evaluate::evaluate(&engine.model, &ids, window, max_windows)?;
    single_box::finish(&engine, store)?;
    if e.windows == 0 {
        bail!(
            "{} tokens do not fill one window of {}",
            ids.len(),
            window + 1
        );
    }
    let v = serde_json::json!({
        "tokens": e.tokens, "windows": e.windows, "perplexity": e.perplexity, "top1_accuracy": e.top1_accuracy,
        "mtp_accuracy": e.mtp_accuracy, "mtp_acceptance": e.mtp_acceptance,
        "top10pct_expert_share": e.top10pct_share, "routing_entropy": e.routing_entropy,
    });
    if json {
        println!("{v}");
    } else {
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    Ok(())
}

fn cmd_demo(single_box: bool, serve: Option<&str>) -> Result<()> {
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
        let template = charm_coordinator::chat::ChatTemplate::from_dir(&bard)?;
        let opts = charm_coordinator::gateway::GatewayOptions {
            model_name: "charm-bard-moe".into(),
            context: e.model.spec.max_position_embeddings.clamp(1, 4096),
            stop_ids: charm_coordinator::gateway::stop_token_ids(&bard, &e.model.spec),
            ..Default::default()
        };
        let rt = tokio::runtime::Runtime::new()?;
        let served = rt.block_on(charm_coordinator::gateway::serve(
            e,
            tok,
            template,
            addr,
            opts,
            |a| {
                println!("serving the OpenAI-compatible API on http://{a} (Ctrl-C stops); try:");
                println!(
                    "curl http://{a}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Speak, Romeo.\"}}], \"max_tokens\": 60}}'"
                );
                use std::io::Write;
                let _ = std::io::stdout().flush();
            },
        ));
        drop(lb);
        served.map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before any other thread exists.
    // A fixed mmap threshold keeps large temporary buffers (dense tensors read while loading,
    // step activations) out of the heap arenas, so freed memory goes back to the system and the
    // peak RSS stays within the planned budget. (Streamed expert records live in their own
    // mappings, see charm_worker::io.)
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
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
    if let Cmd::Worker {
        threads: Some(n), ..
    } = &cli.cmd
    {
        // the forward pass's own pool (charm_shared::par) follows the same count
        charm_shared::par::set_threads(*n);
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads((*n).max(1))
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
        Cmd::Worker { .. } | Cmd::Serve { .. } | Cmd::Demo { serve: true, .. }
    ) {
        run(cli)
    } else {
        rayon::scope(|_| run(cli))
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Logits {
            model,
            ids,
            out,
            mla,
            activations,
            store,
        } => cmd_logits(&model, &ids, &out, mla, activations.into(), &store),
        Cmd::Generate {
            model,
            ids,
            prompt,
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            stop_at_eos,
            json,
            mla,
            activations,
            store,
        } => cmd_generate(
            &model,
            ids.as_deref(),
            prompt.as_deref(),
            max_tokens,
            SamplingParams {
                temperature,
                top_k,
                top_p,
                seed,
                ..Default::default()
            },
            stop_at_eos,
            json,
            mla,
            activations.into(),
            &store,
        ),
        Cmd::Info { model, json } => cmd_info(&model, json),
        Cmd::Convert {
            model,
            out,
            formats,
        } => cmd_convert(&model, &out, &formats.policy()?),
        Cmd::Quality {
            model,
            reference,
            activations,
            json,
            store,
        } => cmd_quality(&model, &reference, json, activations.into(), &store),
        Cmd::Evaluate {
            model,
            ids_file,
            text_file,
            window,
            max_windows,
            activations,
            json,
            store,
        } => cmd_evaluate(
            &model,
            ids_file.as_deref(),
            text_file.as_deref(),
            window,
            max_windows,
            json,
            activations.into(),
            &store,
        ),
        Cmd::Demo {
            single_box,
            serve,
            listen,
        } => cmd_demo(single_box, serve.then_some(listen.as_str())),
        Cmd::Plan {
            model,
            json,
            store,
            formats,
        } => {
            if !single_box::cmd_plan(&model, &store, &formats.policy()?, json)? {
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Doctor {
            model,
            json,
            deep,
            store,
        } => {
            if !single_box::cmd_doctor(&model, &store, json, deep)? {
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Synth {
            out,
            preset,
            layers,
            dense_layers,
            vocab,
            skew,
            experts,
            seed,
            hidden,
            moe_intermediate,
            n_experts,
            top_k,
        } => {
            if !(skew >= 0.0 && skew.is_finite()) {
                bail!("--skew must be >= 0");
            }
            single_box::cmd_synth(
                &out,
                &charm_coordinator::synth::SynthOptions {
                    preset,
                    moe_layers: layers,
                    dense_layers,
                    vocab,
                    skew,
                    experts: single_box::parse_experts_format(&experts)?,
                    seed,
                    hidden,
                    moe_intermediate,
                    n_experts,
                    top_k,
                },
            )
        }
        Cmd::Iobench(args) => single_box::cmd_iobench(&args),
        Cmd::Worker {
            listen,
            model,
            node,
            activations,
            threads,
            fetch_shard,
            store,
        } => {
            // (the pool was sized in main)
            let _ = threads;
            cluster_cli::cmd_worker(
                &listen,
                &model,
                &node,
                &store,
                activations.into(),
                fetch_shard,
            )
        }
        Cmd::Serve {
            model,
            listen,
            api_key_file,
            name,
            queue,
            parallel,
            batch_tokens,
            prefix_cache_mb,
            kv_dir,
            kv_disk_mb,
            activations,
            store,
        } => cluster_cli::cmd_serve(
            &model,
            &listen,
            api_key_file.as_deref(),
            name,
            (queue, parallel, batch_tokens, prefix_cache_mb),
            kv_dir.map(|d| (d, kv_disk_mb << 20)),
            activations.into(),
            &store,
        ),
        Cmd::Chat {
            model,
            url,
            api_key_file,
            max_tokens,
            temperature,
            top_p,
            seed,
            activations,
            store,
        } => {
            if !(temperature >= 0.0 && temperature.is_finite()) {
                bail!("--temperature must be >= 0");
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                bail!("--top-p must be in (0, 1]");
            }
            if max_tokens == 0 {
                bail!("--max-tokens must be at least 1");
            }
            let set = chat_cli::ChatSettings {
                params: SamplingParams {
                    temperature,
                    top_p,
                    seed,
                    ..Default::default()
                },
                max_tokens,
            };
            match (model, url) {
                (Some(m), _) => chat_cli::chat_local(&m, &store, activations.into(), set),
                (None, Some(u)) => {
                    let key = match api_key_file {
                        Some(f) => Some(
                            std::fs::read_to_string(&f)
                                .with_context(|| format!("--api-key-file {}", f.display()))?
                                .trim()
                                .to_string(),
                        ),
                        None => None,
                    };
                    chat_cli::chat_remote(&u, key.as_deref(), set)
                }
                (None, None) => bail!("give --model or --url"),
            }
        }
        Cmd::Cluster { cmd } => match cmd {
            ClusterCmd::Init { out, nodes } => cluster_cli::cmd_cluster_init(&out, &nodes),
            ClusterCmd::Status { model, json, store } => {
                cluster_cli::cmd_cluster_status(&model, &store, json)
            }
        },
    }
}
