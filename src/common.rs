//! What several command groups share: the store flags ([`StoreArgs`]) and the single-box engine
//! they load, the activation-mode and storage-format flags, token-id lists, and the handshake
//! with a cluster's workers (`charm plan --cluster`, `charm cluster status`).
//!
//! The command modules depend on this one and never on each other.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use charm_coordinator::cluster::remote::RemoteExperts;
use charm_coordinator::cluster::{model_fingerprint, ClusterOptions, WorkerAddr};
use charm_coordinator::decode::speculative::{DraftOptions, DraftSource};
use charm_coordinator::model::engine::{DenseDevice, VramBudget};
use charm_coordinator::ops::plan::PlanInput;
use charm_coordinator::{Engine, EngineOptions, HistoryPolicy};
use charm_shared::config::ModelSpec;
use charm_shared::container::{Policy, StoreFormat};
use charm_shared::quant::Activations;
use clap::{Args, ValueEnum};

pub const GIB: f64 = (1u64 << 30) as f64;

/// Activations against quantized weights (the `--activations` flag).
#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum Act {
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

/// The wire name of an activation mode.
pub fn act_name(a: Activations) -> &'static str {
    match a {
        Activations::F32 => "f32",
        Activations::Int8 => "int8",
    }
}

/// Token ids separated by commas (`--ids`).
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
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

/// `--threads`: a whole number of at least one.
fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "{s:?} is not a thread count (a whole number, at least 1)"
        )),
    }
}

/// How routed experts of a charm container are held (single-box mode).
#[derive(Args, Debug, Clone)]
pub struct StoreArgs {
    /// Compute threads of the forward pass and the expert store (default: one per core, or
    /// `RAYON_NUM_THREADS`); `charm worker`'s network threads too. Results are the same bits
    /// at any count.
    #[arg(long, value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// RAM budget in GiB for the whole process (default: MemAvailable less a margin). Routed
    /// experts that do not fit stream from disk.
    #[arg(long)]
    pub ram: Option<f64>,
    /// Context tokens to reserve KV cache for (default: what the command needs).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Reader threads fetching experts from disk.
    #[arg(long, default_value_t = 4)]
    pub readers: usize,
    /// Routing-usage history file for the pinned hot set, or `none` (default: one per model
    /// under $XDG_CACHE_HOME/charm or ~/.cache/charm).
    #[arg(long)]
    pub history: Option<String>,
    /// Share of the expert cache given to pinned experts.
    #[arg(long, default_value_t = 0.5)]
    pub pin_fraction: f64,
    /// Buffered reads instead of O_DIRECT.
    #[arg(long)]
    pub no_direct: bool,
    /// Write the expert store's I/O timeline here at the end, one JSON object per line (each
    /// disk read, each wait of the forward pass for experts, each layer's expert step);
    /// `benches/io_phases.py FILE` summarizes it.
    #[arg(long)]
    pub io_trace: Option<PathBuf>,
    /// Cluster file (JSON: workers, certificates, deadline, replicas; see deploy/cluster.json)
    /// or a cluster directory made by `charm cluster init` (its cluster.json). Routed experts go
    /// to the workers; what none answers runs here. `charm plan` also takes a described cluster
    /// (a JSON file with a `machines` list, see deploy/machines.json) to predict its speed.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Expert workers, `NAME@HOST:PORT,...` (instead of the cluster file's list).
    #[arg(long, requires = "cluster")]
    pub workers: Option<String>,
    /// Copies of each hot expert on different workers (instead of the cluster file's).
    #[arg(long, requires = "cluster")]
    pub replicas: Option<usize>,
    /// Share of each layer's experts, hottest first, that get `--replicas` copies (instead of
    /// the cluster file's; default 0.25).
    #[arg(long, requires = "cluster")]
    pub hot_share: Option<f64>,
    /// VRAM in GiB for routed experts on each GPU, or `auto` (the device's free memory less
    /// 10%, at least 1 GiB); needs `--activations int8` and a container with int8/int4
    /// experts: the hottest experts run there with the CPU's bits, the rest stay in RAM or
    /// stream from disk.
    #[arg(long)]
    pub vram: Option<String>,
    /// The GPU adapters for `--vram` and `--dense-device gpu`, by their numbers in `charm
    /// doctor`, comma-separated (experts are spread over them and the dense skeleton goes to
    /// the first; default: the first that passes its self-check).
    #[arg(long, value_delimiter = ',')]
    pub gpu: Vec<usize>,
    /// Where the dense skeleton (attention, norms, router, shared experts, head) and its KV
    /// cache run: `cpu`, `gpu` (every dense kernel on the GPU with the CPU's bits), or `auto`
    /// (the GPU when one passes its self-check, takes the model, and holds the skeleton and the
    /// KV cache of the context; else the CPU).
    #[arg(long, value_enum, default_value = "cpu")]
    pub dense_device: DenseAt,
}

/// `--dense-device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DenseAt {
    Cpu,
    Gpu,
    Auto,
}

impl StoreArgs {
    /// The engine options these flags give for `context` tokens (unless `--ctx` says otherwise)
    /// and activation mode `activations`.
    pub fn engine_options(
        &self,
        context: usize,
        activations: Activations,
    ) -> Result<EngineOptions> {
        let ram = match self.ram {
            Some(g) if !(g > 0.0 && g.is_finite()) => {
                bail!("--ram must be a positive number of GiB")
            }
            Some(g) => Some((g * GIB) as u64),
            None => None,
        };
        if !(0.0..=1.0).contains(&self.pin_fraction) {
            bail!("--pin-fraction must be in [0, 1]");
        }
        if self.readers == 0 || self.readers > 64 {
            bail!("--readers must be in 1..=64");
        }
        Ok(EngineOptions {
            ram,
            context: self.ctx.unwrap_or(context),
            batch_tokens: None,
            readers: self.readers,
            history: match self.history.as_deref() {
                None => HistoryPolicy::PerModel,
                Some("none") => HistoryPolicy::Off,
                Some(p) => HistoryPolicy::File(PathBuf::from(p)),
            },
            pin_fraction: self.pin_fraction,
            direct: !self.no_direct,
            trace: self.io_trace.is_some(),
            activations,
            cluster: self.cluster_options()?,
            vram: self.vram_bytes()?,
            gpu: self.gpu.clone(),
            dense_device: match self.dense_device {
                DenseAt::Cpu => DenseDevice::Cpu,
                DenseAt::Gpu => DenseDevice::Gpu,
                DenseAt::Auto => DenseDevice::Auto,
            },
        })
    }

    /// `--vram` as a budget.
    fn vram_bytes(&self) -> Result<Option<VramBudget>> {
        match self.vram.as_deref() {
            None => Ok(None),
            Some("auto") => Ok(Some(VramBudget::Auto)),
            Some(v) => match v.parse::<f64>() {
                Ok(g) if g > 0.0 && g.is_finite() => Ok(Some(VramBudget::Bytes((g * GIB) as u64))),
                _ => bail!("--vram must be a positive number of GiB or `auto`"),
            },
        }
    }

    /// The cluster to use: the cluster file, with `--workers`, `--replicas` and `--hot-share`
    /// applied.
    pub fn cluster_options(&self) -> Result<Option<ClusterOptions>> {
        let Some(path) = &self.cluster else {
            return Ok(None);
        };
        let mut o = ClusterOptions::load(path).map_err(anyhow::Error::msg)?;
        if let Some(w) = &self.workers {
            o.workers = w
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| s.parse::<WorkerAddr>().map_err(anyhow::Error::msg))
                .collect::<Result<_>>()?;
        }
        if let Some(r) = self.replicas {
            o.replicas = r;
        }
        if let Some(h) = self.hot_share {
            o.hot_share = h;
        }
        o.check().map_err(anyhow::Error::msg)?;
        Ok(Some(o))
    }

    /// The planner's input for `dir` with `context` tokens (unless `--ctx` says otherwise).
    pub fn plan_input(&self, dir: &Path, context: usize) -> Result<PlanInput> {
        Ok(self
            .engine_options(context, Activations::F32)?
            .plan_input(dir))
    }
}

/// Loads `dir` for `context` tokens as the flags say (see [`Engine::load`]), printing the load's
/// warnings.
pub fn load(
    dir: &Path,
    args: &StoreArgs,
    context: usize,
    activations: Activations,
) -> Result<Engine> {
    let e = Engine::load(dir, &args.engine_options(context, activations)?)
        .with_context(|| format!("loading {}", dir.display()))?;
    for w in &e.warnings {
        eprintln!("warning: {w}");
    }
    Ok(e)
}

/// Saves the routing history of a streaming model, warning on failure, and writes the I/O
/// timeline when `--io-trace` asked for one.
pub fn finish(e: &Engine, args: &StoreArgs) -> Result<()> {
    if let Err(w) = e.finish() {
        eprintln!("warning: {w}");
    }
    if let Some(p) = &args.io_trace {
        let mut out = String::new();
        for ev in &e.io_trace() {
            out += &serde_json::to_string(ev)?;
            out.push('\n');
        }
        std::fs::write(p, out).with_context(|| format!("writing {}", p.display()))?;
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
#[derive(Args, Debug, Clone)]
pub struct FormatArgs {
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
    pub fn policy(&self) -> Result<Policy> {
        let q = ["int8", "int4", "int2", "bf16"];
        let policy = Policy {
            experts: store_format("experts", &self.experts, &q)?,
            dense: store_format("dense", &self.dense, &q)?,
            embedding: store_format("embedding", &self.embedding, &q)?,
            mtp: store_format("mtp", &self.mtp, &q)?,
            group: self.group,
        };
        charm_coordinator::ops::convert::check_policy(&policy)?;
        Ok(policy)
    }
}

/// Handshakes with every worker of `opts` for `model`, without loading it, in activation mode
/// `act` (`None`: any, for a view that sends no expert work); experts no worker answers are
/// refused, never computed here. Returns the warnings of workers that did not answer.
pub fn probe(
    model: &Path,
    opts: &ClusterOptions,
    act: Option<Activations>,
) -> Result<(RemoteExperts, ModelSpec, Vec<String>)> {
    let spec = ModelSpec::from_dir(model)?;
    let fingerprint = model_fingerprint(model).map_err(anyhow::Error::msg)?;
    let (r, warnings) = RemoteExperts::connect(
        opts,
        &fingerprint,
        act.map(act_name),
        &spec,
        Default::default(),
        Arc::new(charm_coordinator::cluster::remote::NoLocalExperts),
        None,
    )
    .map_err(anyhow::Error::msg)?;
    Ok((r, spec, warnings))
}

/// Speculative decoding flags (`generate`, `chat`, `serve`).
#[derive(Args, Debug, Clone)]
pub struct DraftArgs {
    /// Speculative decoding: the most tokens drafted per step, verified together by the model
    /// (0 = off). The output is the same tokens with or without it. Default: 3 with --cluster
    /// (a step's round trips dominate there: measured 1.55-1.96x over two loopback workers),
    /// else 0 (on one box it measured level with plain decoding).
    #[arg(long)]
    pub draft: Option<usize>,
    /// Where drafts come from: auto (the model's MTP layer with prompt lookup beside it where
    /// the text repeats, else prompt lookup), mtp (the MTP layer alone) or lookup.
    #[arg(long, default_value = "auto")]
    pub draft_source: DraftSource,
    /// Always draft --draft tokens, instead of choosing per step (none included) from the
    /// measured acceptance and step times.
    #[arg(long)]
    pub draft_fixed: bool,
}

/// Drafts per step when `--draft` is not given and experts go to a cluster's workers.
pub const CLUSTER_DRAFT: usize = 3;

impl DraftArgs {
    /// The options, for a run on a cluster or on this box alone.
    pub fn options(&self, cluster: bool) -> DraftOptions {
        let default = if cluster { CLUSTER_DRAFT } else { 0 };
        DraftOptions {
            max: self.draft.unwrap_or(default),
            source: self.draft_source,
            adaptive: !self.draft_fixed,
        }
    }
}
