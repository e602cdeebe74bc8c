//! Single-box mode on the command line: the store flags and the engine options they give,
//! `charm plan`, `charm doctor`, `charm synth`, `charm iobench`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use charm_coordinator::cluster::{ClusterOptions, WorkerAddr};
use charm_coordinator::plan::{human, PlanInput};
use charm_coordinator::synth::{synth, SynthOptions};
use charm_coordinator::{Engine, EngineOptions, HistoryPolicy};
use charm_shared::container::{Policy, StoreFormat};
use charm_shared::quant::Activations;
use charm_worker::io::Pages;
use charm_worker::iobench;
use clap::Args;

const GIB: f64 = (1u64 << 30) as f64;

/// How routed experts of a charm container are held (single-box mode).
#[derive(Args, Debug, Clone)]
pub struct StoreArgs {
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
    /// to the workers; what none answers runs here.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Expert workers, `NAME@HOST:PORT,...` (instead of the cluster file's list).
    #[arg(long, requires = "cluster")]
    pub workers: Option<String>,
    /// Copies of each hot expert on different workers (instead of the cluster file's).
    #[arg(long, requires = "cluster")]
    pub replicas: Option<usize>,
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
        })
    }

    /// The cluster to use: the cluster file, with `--workers` and `--replicas` applied.
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

pub fn cmd_plan(dir: &Path, args: &StoreArgs, formats: &Policy, json: bool) -> Result<bool> {
    let input = PlanInput {
        policy: formats.clone(),
        ..args.plan_input(dir, 4096)?
    };
    let p = charm_coordinator::plan::plan(dir, &input)?;
    let cluster = match args.cluster_options()? {
        Some(c) => Some(crate::cluster_cli::plan_cluster(dir, &c, p.expert_bytes)?),
        None => None,
    };
    if json {
        let mut v = serde_json::to_value(&p)?;
        if let Some(c) = &cluster {
            v["cluster"] = serde_json::to_value(c)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", p.render());
        if let Some(c) = &cluster {
            print!("{}", c.render());
        }
    }
    Ok(p.fits)
}

pub fn cmd_doctor(dir: &Path, args: &StoreArgs, json: bool, deep: bool) -> Result<bool> {
    let input = args.plan_input(dir, 4096)?;
    let r = charm_coordinator::doctor::doctor(dir, &input, deep, !args.no_direct);
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", r.render());
    }
    Ok(r.runnable)
}

pub fn cmd_synth(out: &Path, o: &SynthOptions) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("template"),
    );
    let r = synth(out, o, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .map_err(anyhow::Error::msg)?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {}: dense skeleton {}, {} experts of {} = {}",
        out.display(),
        human(r.dense_bytes),
        r.experts,
        human(r.record_bytes),
        human(r.expert_bytes)
    );
    Ok(())
}

pub fn parse_experts_format(s: &str) -> Result<StoreFormat> {
    match StoreFormat::parse(s) {
        Some(f @ (StoreFormat::Int4 | StoreFormat::Int8 | StoreFormat::Int2)) => Ok(f),
        _ => bail!("--experts must be int4, int8 or int2"),
    }
}

/// What `charm iobench` reads and how.
#[derive(Args, Debug, Clone)]
pub struct IoBenchArgs {
    /// Read the expert files of this container.
    #[arg(long, conflicts_with = "dir")]
    pub model: Option<PathBuf>,
    /// Or make a scratch file here (removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Block size in MiB (a GLM-5.2 int4 expert is about 19 MB).
    #[arg(long, default_value_t = 18.0)]
    pub block_mib: f64,
    /// Scratch file size in GiB.
    #[arg(long, default_value_t = 4.0)]
    pub file_gib: f64,
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Buffered reads instead of O_DIRECT.
    #[arg(long)]
    pub no_direct: bool,
    /// Threads streaming memory while the reads run (0: none): how much a memory-bound
    /// forward pass slows the disk on this machine.
    #[arg(long, default_value_t = 0)]
    pub memory_load: usize,
    /// Read into 4 KiB pages instead of 2 MiB huge pages (what charm's buffers use): how much
    /// huge pages are worth for reads on this machine.
    #[arg(long)]
    pub small_pages: bool,
    #[arg(long)]
    pub json: bool,
}

/// `charm iobench`: random aligned reads of `block_mib` from a model's expert files, or from a
/// scratch file of `file_gib` made in `dir`.
pub fn cmd_iobench(a: &IoBenchArgs) -> Result<()> {
    if !(a.block_mib > 0.0 && a.block_mib <= 1024.0) {
        bail!("--block-mib must be in (0, 1024]");
    }
    if a.memory_load > 64 {
        bail!("--memory-load must be in 0..=64");
    }
    let block = (a.block_mib * (1u64 << 20) as f64) as usize;
    let source = match (&a.model, &a.dir) {
        (Some(m), _) => iobench::Source::Container(m.clone()),
        (None, Some(d)) => iobench::Source::Scratch {
            dir: d.clone(),
            bytes: (a.file_gib * GIB) as u64,
        },
        _ => bail!("give --model DIR or --dir DIR"),
    };
    let cfg = iobench::Config {
        block,
        seconds: a.seconds,
        threads: a.threads,
        direct: !a.no_direct,
        memory_load: a.memory_load,
        pages: if a.small_pages {
            Pages::Small
        } else {
            Pages::Huge
        },
    };
    let rep = iobench::run(&source, &cfg)?;
    let (r, mem_bps) = (rep.reads, rep.memory_load_bytes_per_s);
    if a.json {
        let mut v = serde_json::to_value(r)?;
        v["bytes_per_s"] = r.bytes_per_s().into();
        v["memory_load_threads"] = a.memory_load.into();
        v["memory_load_bytes_per_s"] = mem_bps.into();
        println!("{v}");
    } else {
        println!(
            "{:.3} GB/s: {} random reads of {:.2} MiB in {:.2}s, {} threads, {}, into {}",
            r.bytes_per_s() / 1e9,
            r.reads,
            r.block_bytes as f64 / (1u64 << 20) as f64,
            r.seconds,
            r.threads,
            if r.direct { "O_DIRECT" } else { "buffered" },
            match r.pages {
                Pages::Huge => "huge pages where the kernel allows",
                Pages::Small => "4 KiB pages",
            }
        );
        if a.memory_load > 0 {
            println!(
                "  beside {} thread(s) streaming memory at {:.1} GB/s",
                a.memory_load,
                mem_bps / 1e9
            );
        }
    }
    Ok(())
}
