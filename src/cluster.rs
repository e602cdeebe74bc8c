//! The cluster on the command line: `charm worker`, `charm cluster init`, `charm cluster status`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use charm_coordinator::cluster::remote::moe_layers;
use charm_coordinator::cluster::{model_fingerprint, ClusterOptions};
use charm_coordinator::Engine;
use charm_shared::quant::Activations;
use charm_shared::wire::{Hello, LayerExperts, Limits, PROTOCOL_VERSION};
use clap::{Args, Subcommand};

use crate::common::{self, act_name, Act, StoreArgs};

/// The flags of `charm worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on (UDP), e.g. 0.0.0.0:7070 (port 0: any free port).
    #[arg(long)]
    pub listen: String,
    #[arg(long)]
    pub model: PathBuf,
    /// This worker's node name: its certificate in the cluster directory.
    #[arg(long)]
    pub node: String,
    /// Activation mode it computes in (the coordinator's must match).
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: Act,
    /// MODEL may lack expert records (a directory with only `config.json` and `charm.json`
    /// will do): the worker fetches those of the experts placed on it from the coordinator,
    /// checksummed, resuming after a restart (journal `shard.log` in MODEL).
    #[arg(long)]
    pub fetch_shard: bool,
    /// Microseconds this worker's network thread keeps polling after each answer, so that the
    /// next request of a decode finds it running instead of asleep (0: sleep at once; costs a
    /// core while requests come).
    #[arg(long, default_value_t = charm_worker::server::WORKER_SPIN_US)]
    pub spin_us: u64,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// `charm worker`: serves the routed experts of `model` to the cluster's coordinator until
/// killed. Prints `listening on ADDR` once it accepts connections. With `fetch_shard`, `model`
/// may hold only the config and the container manifest: the records of the experts placed on
/// it come from the coordinator.
pub fn worker(a: &WorkerArgs) -> Result<()> {
    // (`--threads` sized the compute pools in main)
    let (listen, model, node, args) = (a.listen.as_str(), &a.model, a.node.as_str(), &a.store);
    let (act, fetch_shard) = (Activations::from(a.activations), a.fetch_shard);
    let Some(cluster) = &args.cluster else {
        bail!("give --cluster (a cluster file or the directory `charm cluster init` made): workers only speak mutual TLS");
    };
    if args.workers.is_some() || args.replicas.is_some() || args.hot_share.is_some() {
        bail!("--workers, --replicas and --hot-share are the coordinator's");
    }
    let certs = ClusterOptions::load(cluster)
        .map_err(anyhow::Error::msg)?
        .certs;
    let addr: std::net::SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(listen)
        .with_context(|| format!("--listen {listen}"))?
        .next()
        .with_context(|| format!("--listen {listen}: no address"))?;
    let identity = charm_worker::tls::Identity::load(&certs, node)
        .with_context(|| format!("node {node} of {}", certs.display()))?;
    let mut opts = args.engine_options(4096, act)?;
    opts.cluster = None;
    let shard = if fetch_shard {
        let s = charm_worker::shard::Shard::open(model)
            .with_context(|| format!("preparing {} for fetching", model.display()))?;
        eprintln!(
            "worker {node}: holds {} expert records; fetches the rest of its shard from the coordinator",
            s.held()
        );
        Some(Arc::new(s))
    } else {
        None
    };
    let e = Engine::load_experts(model, &opts, shard.is_none())
        .with_context(|| format!("loading {}", model.display()))?;
    for w in &e.warnings {
        eprintln!("warning: {w}");
    }
    let spec = &e.spec;
    let layers = moe_layers(spec);
    let rate = expert_rate(&*e.executor, spec.hidden_size, &layers);
    let svc = Arc::new(charm_worker::server::Service {
        executor: e.executor.clone(),
        hello: Hello {
            version: PROTOCOL_VERSION,
            node: node.to_string(),
            model: model_fingerprint(model).map_err(anyhow::Error::msg)?,
            activations: vec![act_name(act).into()],
            experts: layers
                .iter()
                .map(|&(l, n)| LayerExperts {
                    layer: l as u32,
                    ids: (0..n as u32).collect(),
                })
                .collect(),
            ram_bytes: e.ram_bytes,
            disk_free_bytes: charm_worker::io::free_bytes(model).unwrap_or(0),
            expert_rate: rate,
            fetches: shard.is_some(),
            act_group: e.act_group.unwrap_or(0) as u32,
            vram_bytes: e.vram.as_ref().map_or(0, |v| v.bytes()),
            gpu: e.vram.as_ref().map_or(String::new(), |v| {
                v.gpus()
                    .iter()
                    .map(|g| g.name.clone())
                    .collect::<Vec<_>>()
                    .join(", ")
            }),
        },
        limits: Limits {
            hidden: spec.hidden_size,
            n_experts: layers.first().map_or(0, |l| l.1),
            max_tokens: 1 << 16,
        },
        shard,
        warm: charm_worker::server::Warm::new(std::time::Duration::from_micros(a.spin_us)),
        vram: e.vram.clone(),
    });
    let vram = e.vram.as_ref().map_or(String::new(), |v| {
        format!(
            " and {:.2} GiB of VRAM on {} ({} experts)",
            v.bytes() as f64 / (1u64 << 30) as f64,
            v.gpus()
                .iter()
                .map(|g| g.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            v.resident()
        )
    });
    eprintln!(
        "worker {node}: {} MoE layers, {:.2} GiB for experts{vram}, {rate:.0} expert rows/s",
        layers.len(),
        e.ram_bytes as f64 / (1u64 << 30) as f64
    );
    // the network threads: as many as the compute threads it was given (default: one per core),
    // so that a worker sharing a machine (`--threads` below its cores) does not spread its
    // packets over threads that then wait for cores
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = a.store.threads {
        rt.worker_threads(n);
    }
    let rt = rt.enable_all().build()?;
    rt.block_on(async move {
        let ep = charm_worker::server::listen(addr, &identity)
            .map_err(|e| anyhow::anyhow!("--listen {addr}: {e}"))?;
        // the bound address (port 0 picks one), for scripts and tests
        println!("listening on {}", ep.local_addr()?);
        std::io::stdout().flush()?;
        charm_worker::server::serve(ep, svc).await;
        Ok::<_, anyhow::Error>(())
    })
}

/// Expert rows per second `executor` computes: the best of repeated one-row runs over up to 16
/// experts of the first MoE layer, for at least 300 ms and 5 runs (0 when there is none or it
/// fails).
fn expert_rate(
    executor: &dyn charm_shared::expert::ExpertExecutor,
    hidden: usize,
    layers: &[(usize, usize)],
) -> f64 {
    let Some(&(layer, n)) = layers.first() else {
        return 0.0;
    };
    let k = n.min(16);
    let x: Vec<f32> = (0..k * hidden).map(|i| ((i as f32) * 0.01).sin()).collect();
    let ids: Vec<u32> = (0..k as u32).collect();
    let w = vec![1.0f32; k];
    let mut best = f64::INFINITY;
    let start = std::time::Instant::now();
    for run in 0.. {
        if run >= 5 && start.elapsed().as_secs_f64() > 0.3 {
            break;
        }
        let t = std::time::Instant::now();
        let b = charm_shared::expert::ExpertBatch {
            step: 0,
            layer,
            x: &x,
            n_tokens: k,
            ids: &ids,
            weights: &w,
            top_k: 1,
        };
        if executor.run(b).is_err() {
            return 0.0;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    k as f64 / best.max(1e-9)
}

/// The subcommands of `charm cluster` (parsed once per process: the size of a variant is of no
/// account).
#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum ClusterCmd {
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

/// `charm cluster init` and `charm cluster status`.
pub fn cluster(cmd: &ClusterCmd) -> Result<()> {
    match cmd {
        ClusterCmd::Init { out, nodes } => init(out, nodes),
        ClusterCmd::Status { model, json, store } => status(model, store, *json),
    }
}

/// `charm cluster init`: a cluster authority and node certificates in `out`.
fn init(out: &Path, nodes: &str) -> Result<()> {
    let mut names: Vec<String> = nodes
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if !names.iter().any(|n| n == "coordinator") {
        names.insert(0, "coordinator".into());
    }
    let files = charm_worker::tls::init_cluster(out, &names)?;
    for f in files {
        println!("{}", f.display());
    }
    eprintln!(
        "copy ca.pem and NODE.pem/NODE.key to each node (keep ca.key here); list the workers in {}",
        out.join(charm_coordinator::cluster::CLUSTER_FILE).display()
    );
    Ok(())
}

/// `charm cluster status`: dials every worker of the cluster for `model` and reports each one's
/// health, holdings and latency.
fn status(model: &Path, args: &StoreArgs, json: bool) -> Result<()> {
    let Some(opts) = args.cluster_options()? else {
        bail!("give --cluster");
    };
    let (r, _, warnings) = common::probe(model, &opts, None)?;
    let fingerprint = model_fingerprint(model).map_err(anyhow::Error::msg)?;
    // one heartbeat, for a round-trip figure
    std::thread::sleep(opts.heartbeat + std::time::Duration::from_millis(50));
    let st = r.status();
    if json {
        println!(
            "{}",
            serde_json::json!({ "model": fingerprint, "workers": st })
        );
    } else {
        for w in &warnings {
            eprintln!("warning: {w}");
        }
        println!("model {fingerprint}, {} workers", st.len());
        for w in &st {
            let health = match (&w.error, w.connected) {
                (_, true) => "up".to_string(),
                (Some(e), false) => format!("down: {e}"),
                (None, false) => "down".to_string(),
            };
            let vram = if w.vram_bytes > 0 {
                format!(
                    ", {:.1} GiB expert VRAM on {}",
                    w.vram_bytes as f64 / (1u64 << 30) as f64,
                    w.gpu
                )
            } else {
                String::new()
            };
            println!(
                "  {:<12} {:<22} {health}; {} experts placed, {:.1} GiB expert RAM{vram}, {:.0} expert rows/s, {:.0} GiB disk free, ping {}",
                w.name,
                w.addr,
                w.experts,
                w.ram_bytes as f64 / (1u64 << 30) as f64,
                w.expert_rate,
                w.disk_free_bytes as f64 / (1u64 << 30) as f64,
                w.ping_ms.map_or("-".into(), |p| format!("{p:.2} ms"))
            );
        }
    }
    if st.iter().all(|w| !w.connected) {
        std::process::exit(1);
    }
    Ok(())
}
