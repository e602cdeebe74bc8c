//! Looking at a model and a machine before running: `charm plan` (the memory plan), `charm doctor`
//! (readiness checks), `charm info` (what a model holds), `charm synth` (a synthetic container of
//! a large model's shapes) and `charm iobench` (the disk's read speed).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use charm_coordinator::cluster::predict::{self, ModelCost as ClusterCost};
use charm_coordinator::cluster::probe;
use charm_coordinator::cluster::HOT_SHARE;
use charm_coordinator::model::engine::DenseDevice;
use charm_coordinator::ops;
use charm_coordinator::ops::info::ModelInfo;
use charm_coordinator::ops::plan::{human, PlanInput};
use charm_coordinator::ops::synth::SynthOptions;
use charm_shared::container::StoreFormat;
use charm_shared::quant::Activations;
use charm_worker::io::Pages;
use charm_worker::iobench;
use clap::Args;

use crate::common::{self, Act, FormatArgs, StoreArgs, CLUSTER_DRAFT, GIB};

/// The flags of `charm plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Storage formats assumed for a checkpoint (a container has its own).
    #[command(flatten, next_help_heading = "Formats assumed for a checkpoint")]
    pub formats: FormatArgs,
    /// With --cluster: the activation mode the speed is predicted for (the workers' mode).
    #[arg(
        long,
        value_enum,
        default_value = "f32",
        help_heading = "Speed with --cluster"
    )]
    pub activations: Act,
    /// With --cluster: also predict speculative decoding with this many drafts per step (0:
    /// plain decoding only).
    #[arg(long, default_value_t = CLUSTER_DRAFT, help_heading = "Speed with --cluster")]
    pub draft: usize,
    /// With --cluster: the share of drafts accepted, each independently.
    #[arg(long, default_value_t = 0.7, help_heading = "Speed with --cluster")]
    pub acceptance: f64,
    /// With a live cluster: the workers' disk read speed for experts their RAM does not hold,
    /// GB/s (not probed).
    #[arg(long, default_value_t = probe::WORKER_DISK_BYTES_S / 1e9, help_heading = "Speed with --cluster")]
    pub worker_disk_gb_s: f64,
    /// With a live cluster: show the workers and the placement only (no dense pass measured,
    /// no requests sent).
    #[arg(long, help_heading = "Speed with --cluster")]
    pub no_probe: bool,
}

/// `charm plan`: the single-box memory plan; with `--cluster`, the workers' view and the decode
/// speed predicted from them (probed), or from a described set of machines (a JSON file with a
/// `machines` list). Exits 1 when the model does not fit.
pub fn plan(a: &PlanArgs) -> Result<()> {
    let (dir, args, json) = (&a.model, &a.store, a.json);
    if !(a.acceptance >= 0.0 && a.acceptance < 1.0) {
        bail!("--acceptance must be in [0, 1)");
    }
    if !(a.worker_disk_gb_s.is_finite() && a.worker_disk_gb_s > 0.0) {
        bail!("--worker-disk-gb-s must be positive");
    }
    let formats = &a.formats.policy()?;
    let described = match &args.cluster {
        Some(f) if f.is_file() => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            match predict::is_described(&text) {
                true => Some(
                    predict::Described::parse(&text)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?,
                ),
                false => None,
            }
        }
        _ => None,
    };
    // a described cluster is no cluster file: the store flags plan this machine alone
    let args = &StoreArgs {
        cluster: if described.is_some() {
            None
        } else {
            args.cluster.clone()
        },
        ..args.clone()
    };
    let mut input = PlanInput {
        policy: formats.clone(),
        dense_on_gpu: args.dense_device == common::DenseAt::Gpu,
        ..args.plan_input(dir, 4096)?
    };
    if let Some(d) = &described {
        // the plan is the coordinator's machine's
        let c = &d.machines[0];
        input.ram = Some(((c.ram_gib - d.reserve_gib).max(0.0) * GIB) as u64);
        input.mem_bytes_s = c.mem_gb_s * 1e9;
        input.disk_bytes_s = c.disk_gb_s * 1e9;
    }
    let p = ops::plan::plan(dir, &input)?;
    let spec = charm_shared::config::ModelSpec::from_dir(dir)?;
    let act = Activations::from(a.activations);
    let quantized = matches!(p.formats.experts, StoreFormat::Int8 | StoreFormat::Int4);
    let (cluster, prediction) = match (&described, args.cluster_options()?) {
        (Some(d), _) => {
            // int8 activations on int8/int4 experts: requests carry the codes, and the VRAM
            // tier (`--vram`) runs; otherwise neither
            let int_path = act == Activations::Int8 && quantized;
            let group = if int_path { p.formats.group } else { 0 };
            let m = ClusterCost::from_plan(&p, spec.hidden_size, group);
            let d = d.clone();
            let gpus: Vec<&str> = d
                .machines
                .iter()
                .filter(|x| x.gpu.is_some())
                .map(|x| x.name.as_str())
                .collect();
            if !gpus.is_empty() && !int_path {
                eprintln!(
                    "warning: the GPUs hold no routed experts in the prediction ({}): routed experts run in VRAM with int8 or int4 experts and --activations int8 only (here {} experts, {} activations)",
                    gpus.join(", "),
                    p.formats.experts.name(),
                    common::act_name(act)
                );
            }
            let dense = match args.dense_device {
                common::DenseAt::Cpu => DenseDevice::Cpu,
                common::DenseAt::Gpu => DenseDevice::Gpu,
                common::DenseAt::Auto => DenseDevice::Auto,
            };
            let mut setup = d
                .setup_with(&m, dense, int_path)
                .map_err(anyhow::Error::msg)?;
            // the placement a coordinator with these flags makes (no cluster file here)
            setup.replicas = args.replicas.unwrap_or(1);
            setup.hot_share = args.hot_share.unwrap_or(HOT_SHARE);
            if setup.replicas == 0 || !(0.0..=1.0).contains(&setup.hot_share) {
                bail!("--replicas must be at least 1 and --hot-share within 0 to 1");
            }
            (
                None,
                Some(predict::predict(setup, &m, a.draft, a.acceptance)),
            )
        }
        (None, Some(c)) => {
            let (r, _, _) = common::probe(dir, &c, (!a.no_probe).then_some(act))?;
            let cp = r.plan(&spec, p.expert_bytes);
            let prediction =
                if a.no_probe {
                    None
                } else {
                    let o = probe::LiveOptions {
                        act,
                        draft: a.draft,
                        acceptance: a.acceptance,
                        position: args_ctx(a),
                        worker_disk_bytes_s: a.worker_disk_gb_s * 1e9,
                        dense_gpu: args.dense_device == common::DenseAt::Gpu,
                    };
                    Some(probe::predict_live(dir, &r, &spec, &p, o).map_err(|e| {
                        anyhow::anyhow!("{e} (--no-probe shows the placement alone)")
                    })?)
                };
            (Some(cp), prediction)
        }
        (None, None) => (None, None),
    };
    if json {
        let mut v = serde_json::to_value(&p)?;
        if let Some(c) = &cluster {
            v["cluster"] = serde_json::to_value(c)?;
        }
        if let Some(pr) = &prediction {
            v["prediction"] = serde_json::to_value(pr)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", p.render());
        if let Some(c) = &cluster {
            print!("{}", c.render());
        }
        if let Some(pr) = &prediction {
            print!("{}", pr.render());
        }
    }
    if !p.fits {
        std::process::exit(1);
    }
    Ok(())
}

/// The context position the dense pass is timed at: halfway through `--ctx` (default 512).
fn args_ctx(a: &PlanArgs) -> usize {
    a.store.ctx.unwrap_or(512) / 2
}

/// The flags of `charm doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub json: bool,
    /// Verify every checksum (reads the whole model) and measure the disk longer.
    #[arg(long)]
    pub deep: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// `charm doctor`: the readiness checks. Exits 1 when the model is not runnable.
pub fn doctor(a: &DoctorArgs) -> Result<()> {
    let (dir, args, json, deep) = (&a.model, &a.store, a.json, a.deep);
    let input = args.plan_input(dir, 4096)?;
    let r = ops::doctor::doctor(dir, &input, deep, !args.no_direct);
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", r.render());
    }
    if !r.runnable {
        std::process::exit(1);
    }
    Ok(())
}

/// The flags of `charm info`.
#[derive(Args, Debug)]
pub struct InfoArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub json: bool,
}

/// `charm info`: architecture, parameter counts and bytes, as text or JSON.
pub fn info(a: &InfoArgs) -> Result<()> {
    let (model, json) = (&a.model, a.json);
    let info = ModelInfo::read(model).with_context(|| format!("reading {}", model.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&info.to_json())?);
    } else {
        print!("{}", info.render());
    }
    Ok(())
}

/// The flags of `charm synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    #[arg(long)]
    pub out: PathBuf,
    /// glm-5.2 (hidden 6144, 256 experts of width 2048, top-8), yardstick (the shapes of
    /// ../shared/bench/make_bench_model.py with --layers 6 --dense-layers 2) or tiny (test-sized).
    #[arg(long, default_value = "glm-5.2")]
    pub preset: String,
    /// MoE layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Dense layers before them.
    #[arg(long, default_value_t = 1)]
    pub dense_layers: usize,
    /// Vocabulary size (default: the preset's, 154880 for glm-5.2).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Skew of expert popularity (0: uniform; larger: a smaller hot set).
    #[arg(long, default_value_t = 1.0)]
    pub skew: f64,
    #[arg(long, default_value = "int4")]
    pub experts: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Override the preset's hidden size.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Override the routed-expert width.
    #[arg(long)]
    pub moe_intermediate: Option<usize>,
    /// Override the routed experts per layer.
    #[arg(long)]
    pub n_experts: Option<usize>,
    /// Override the experts per token.
    #[arg(long)]
    pub top_k: Option<usize>,
}

/// `charm synth`: writes the synthetic container, with a progress bar.
pub fn synth(a: &SynthArgs) -> Result<()> {
    if !(a.skew >= 0.0 && a.skew.is_finite()) {
        bail!("--skew must be >= 0");
    }
    let out = &a.out;
    let o = &SynthOptions {
        preset: a.preset.clone(),
        moe_layers: a.layers,
        dense_layers: a.dense_layers,
        vocab: a.vocab,
        skew: a.skew,
        experts: parse_experts_format(&a.experts)?,
        seed: a.seed,
        hidden: a.hidden,
        moe_intermediate: a.moe_intermediate,
        n_experts: a.n_experts,
        top_k: a.top_k,
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("template"),
    );
    let r = ops::synth::synth(out, o, &mut |done, total| {
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

fn parse_experts_format(s: &str) -> Result<StoreFormat> {
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
pub fn iobench(a: &IoBenchArgs) -> Result<()> {
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
