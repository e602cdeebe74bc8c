//! The one way to load a model for running: a model directory and [`EngineOptions`] in, a ready
//! [`Engine`] out (the model, whoever executes its routed experts, and the memory plan).
//!
//! - A charm container keeps its dense skeleton resident and streams routed experts from disk
//!   through a RAM cache sized by [`crate::ops::plan`] (single-box mode); the load is refused, saying
//!   what would fit, when the budget cannot hold the skeleton and a minimal cache.
//! - A Hugging Face checkpoint or a colibrì conversion loads every expert in RAM.
//!
//! The command line and the servers keep only argument parsing and printing.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use charm_shared::container::Container;
use charm_shared::expert::{ExpertExecutor, ExpertStats};
use charm_shared::quant::Activations;
use charm_shared::LoadError;
use charm_worker::gpu::tier::{SwapPolicy, VramExperts};
use charm_worker::gpu::Gpu;
use charm_worker::history::container_model_id;
use charm_worker::{IoEvent, StoreOptions, StreamingExperts};

use crate::cluster::remote::RemoteExperts;
use crate::cluster::{model_fingerprint, ClusterOptions};
use crate::model::cache::KvCache;
use crate::model::{open_source, Model};
use crate::ops::plan::{rss, Plan, PlanInput};

/// Where the routing history of a streamed container is kept (it picks the pinned hot set and
/// seeds the cache's usage frequencies).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HistoryPolicy {
    /// One file per model under `$XDG_CACHE_HOME/charm` (or `~/.cache/charm`).
    #[default]
    PerModel,
    /// None kept.
    Off,
    /// This file.
    File(PathBuf),
}

/// Sets glibc's allocator for a process that runs forward passes; call it once at start, before
/// other threads exist (a no-op off glibc).
/// - A fixed mmap threshold of 8 MiB: larger buffers (dense tensors read while loading, the
///   activations of long prefill chunks) get their own mappings and go back to the system when
///   freed, so fragmented arenas cannot hold them and the peak RSS stays within the planned
///   budget (expert records live in their own mappings, `charm_worker::io`). Below it a
///   prefill's activations (a 128-token chunk of the yardstick's 4096-wide MLP: 4 MiB) are reused
///   from the heap instead of being mapped, faulted in page by page and unmapped again in every
///   layer.
/// - A trim threshold of 64 MiB keeps the arenas' freed tops instead of returning every 128 KiB:
///   otherwise each layer's small buffers come back as fresh pages, and the first touch of each
///   (a read of a zeroed buffer, then the write) faults twice and flushes the other cores' TLBs.
///   What an arena keeps is at most what it held at its peak.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 8 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}

/// How to load and run a model.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// RAM budget for the whole process in bytes (`None`: `MemAvailable` less a margin).
    pub ram: Option<u64>,
    /// Context tokens to reserve KV cache for.
    pub context: usize,
    /// Tokens of the longest prefill step to plan for (`None`: the context, at most 512).
    pub batch_tokens: Option<usize>,
    /// Reader threads fetching experts from disk.
    pub readers: usize,
    pub history: HistoryPolicy,
    /// Share of the expert cache given to pinned experts.
    pub pin_fraction: f64,
    /// Try `O_DIRECT` reads (buffered where the filesystem refuses).
    pub direct: bool,
    /// Record the expert store's I/O timeline ([`Engine::io_trace`]).
    pub trace: bool,
    /// How activations meet quantized weights (also fixes their in-memory layout).
    pub activations: Activations,
    /// Expert workers to send routed experts to (`None`: this machine computes them all).
    pub cluster: Option<ClusterOptions>,
    /// VRAM for routed experts on each device (`None`: no GPU): the hottest experts run there.
    pub vram: Option<VramBudget>,
    /// The GPU adapters to use (`charm doctor` lists them; empty: the first that passes its
    /// self-check); experts are spread over them.
    pub gpu: Vec<usize>,
    /// Where the dense skeleton runs.
    pub dense_device: DenseDevice,
}

/// Where the dense skeleton (attention, norms, router, shared experts, head) and the KV cache
/// run. The GPU computes the CPU's bits (`model::gpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseDevice {
    #[default]
    Cpu,
    /// On the GPU; a device that does not open or a model it does not take is an error.
    Gpu,
    /// On the GPU when one opens, takes the model, and holds the skeleton and the KV cache of
    /// the context in its free memory; else on the CPU.
    Auto,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            ram: None,
            context: 4096,
            batch_tokens: None,
            readers: 4,
            history: HistoryPolicy::PerModel,
            pin_fraction: 0.5,
            direct: true,
            trace: false,
            activations: Activations::F32,
            cluster: None,
            vram: None,
            gpu: Vec::new(),
            dense_device: DenseDevice::Cpu,
        }
    }
}

fn cache_home() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
}

impl EngineOptions {
    /// The routing-history file for the model in `dir`, if one is kept.
    pub fn history_path(&self, dir: &Path) -> Option<PathBuf> {
        match &self.history {
            HistoryPolicy::Off => None,
            HistoryPolicy::File(p) => Some(p.clone()),
            HistoryPolicy::PerModel => {
                let id = container_model_id(dir).ok()?;
                Some(
                    cache_home()?
                        .join("charm")
                        .join(format!("routing-{id}.json")),
                )
            }
        }
    }

    /// The planner's input for the model in `dir`.
    pub fn plan_input(&self, dir: &Path) -> PlanInput {
        PlanInput {
            ram: self.ram,
            context: self.context,
            batch_tokens: self
                .batch_tokens
                .unwrap_or_else(|| self.context.clamp(1, 512)),
            readers: self.readers,
            pin_fraction: self.pin_fraction,
            history: self.history_path(dir),
            ..Default::default()
        }
    }
}

/// A loaded model ready to run.
#[derive(Debug)]
pub struct Engine {
    pub model: Model,
    /// The streaming store behind `model.experts` (or behind the cluster client, for experts no
    /// worker answers), when a container streams its experts.
    pub store: Option<Arc<StreamingExperts>>,
    /// The cluster client, when workers compute routed experts.
    pub remote: Option<Arc<RemoteExperts>>,
    /// The VRAM tier, when routed experts run on a GPU.
    pub vram: Option<Arc<VramExperts>>,
    /// The memory plan the load followed (containers).
    pub plan: Option<Plan>,
    /// What the user should know about how the load went (buffered reads where `O_DIRECT` was
    /// refused, a budget that does not apply).
    pub warnings: Vec<String>,
}

impl Engine {
    /// Loads the model in `dir` as `opts` say (see the module docs). With
    /// [`EngineOptions::cluster`] the reachable workers compute routed experts and the local
    /// executor serves what they do not answer; no reachable worker is single-box mode, with a
    /// warning.
    pub fn load(dir: &Path, opts: &EngineOptions) -> Result<Self, LoadError> {
        let workers = opts.cluster.as_ref().is_some_and(|c| !c.workers.is_empty());
        let mut e = if workers && Container::is_container(dir) && !Container::has_expert_files(dir)
        {
            Self::load_dense_only(dir, opts)?
        } else {
            Self::load_local(dir, opts)?
        };
        attach_dense(dir, opts, &mut e.model, &mut e.warnings)?;
        // a GPU holds the dense weights now: their CPU copies go, and where its memory is its
        // own (not the host's RAM, as an integrated GPU's is) the expert cache takes their room
        let dedicated = e
            .model
            .dense_gpu
            .as_ref()
            .is_some_and(|d| d.dedicated_memory());
        let freed = e.model.release_cpu_dense();
        if freed > 0 {
            // (the weights under the mapping threshold were in the heap: hand back its holes)
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: malloc_trim only returns free heap pages to the system.
            unsafe {
                libc::malloc_trim(0);
            }
            if let (Some(store), true) = (&e.store, dedicated) {
                store.grow_cache(freed);
            }
        }
        let hidden = e.model.spec.hidden_size;
        e.vram = attach_vram(dir, opts, hidden, &mut e.model.experts, &mut e.warnings)?;
        let Some(c) = &opts.cluster else {
            return Ok(e);
        };
        if c.workers.is_empty() {
            e.warnings
                .push("the cluster lists no workers: every expert runs on this machine".into());
            return Ok(e);
        }
        let model = model_fingerprint(dir).map_err(|m| LoadError::config(dir, m))?;
        let act = match opts.activations {
            Activations::F32 => "f32",
            Activations::Int8 => "int8",
        };
        let (r, warnings) = RemoteExperts::connect(
            c,
            &model,
            Some(act),
            &e.model.spec,
            routing_heat(dir, opts),
            e.model.experts.clone(),
            // (records for workers that fetch their shard)
            Container::has_expert_files(dir).then_some(dir),
        )
        .map_err(|m| LoadError::config(&c.certs, m))?;
        e.warnings.extend(warnings);
        let r = Arc::new(r);
        e.model.experts = r.clone();
        e.remote = Some(r);
        Ok(e)
    }

    /// A container's dense skeleton only, its routed experts left to the cluster's workers.
    fn load_dense_only(dir: &Path, opts: &EngineOptions) -> Result<Self, LoadError> {
        let spec = charm_shared::config::ModelSpec::from_dir(dir)?;
        let c = Container::open_dense_only(dir)?;
        let none: Arc<dyn ExpertExecutor> = Arc::new(crate::cluster::remote::NoLocalExperts);
        let model = Model::build(spec, &c, Some(none), opts.activations)?;
        Ok(Self {
            model,
            store: None,
            remote: None,
            vram: None,
            plan: None,
            warnings: vec![format!(
                "{} has no expert files: every routed expert comes from the workers, and a step whose experts no live worker holds fails",
                dir.display()
            )],
        })
    }

    fn load_local(dir: &Path, opts: &EngineOptions) -> Result<Self, LoadError> {
        if !Container::is_container(dir) {
            let mut warnings = Vec::new();
            if opts.ram.is_some() {
                warnings.push(format!("--ram applies to charm containers; {} loads every expert in RAM (convert it to stream experts)", dir.display()));
            }
            let (spec, src) = open_source(dir)?;
            let model = Model::from_source(spec, &*src, opts.activations)?;
            return Ok(Self {
                model,
                store: None,
                remote: None,
                vram: None,
                plan: None,
                warnings,
            });
        }
        let input = opts.plan_input(dir);
        let (spec, c) = crate::model::open_container(dir)?;
        let p = crate::ops::plan::plan_container(dir, &spec, &c, &input)?;
        if !p.fits {
            return Err(LoadError::config(dir, p.refusal()));
        }
        let store = StreamingExperts::open(
            &c,
            spec.hidden_size,
            spec.moe_intermediate_size,
            StoreOptions {
                cache_bytes: p.cache_bytes,
                readers: input.readers,
                direct: opts.direct,
                pin_fraction: if p.all_resident {
                    0.0
                } else {
                    input.pin_fraction
                },
                history: input.history.clone(),
                trace: opts.trace,
                top_k: spec.router.as_ref().map_or(0, |r| r.top_k),
                activations: opts.activations,
                ..Default::default()
            },
        )
        .map_err(|e| LoadError::config(dir, e.to_string()))?;
        let store = Arc::new(store);
        if p.all_resident {
            store.warm_all();
        }
        let executor: Arc<dyn ExpertExecutor> = store.clone();
        let model = Model::build(spec, &c, Some(executor), opts.activations)?;
        // Pinned and (when everything fits) all experts finish loading before the first token.
        store
            .wait_warm()
            .map_err(|e| LoadError::config(dir, e.to_string()))?;
        let warnings = io_warnings(&store);
        Ok(Self {
            model,
            store: Some(store),
            remote: None,
            vram: None,
            plan: Some(p),
            warnings,
        })
    }

    /// The expert executor's counters since start.
    pub fn stats(&self) -> Option<ExpertStats> {
        self.model.experts.stats()
    }

    /// Saves what the run learned (the routing history of a streamed container).
    pub fn finish(&self) -> Result<(), String> {
        match &self.store {
            Some(s) => s
                .save_history()
                .map_err(|e| format!("routing history not saved: {e}")),
            None => Ok(()),
        }
    }

    /// The expert store's I/O timeline (empty unless [`EngineOptions::trace`]).
    pub fn io_trace(&self) -> Vec<IoEvent> {
        self.store
            .as_ref()
            .map(|s| s.io_trace())
            .unwrap_or_default()
    }

    /// Per-run statistics as JSON: the executor's counters for the run `run`, peak RSS and the
    /// plan's budget.
    pub fn run_stats(&self, run: Option<&ExpertStats>) -> serde_json::Value {
        let mut v = serde_json::json!({ "dense": self.model.dense_status() });
        if let Some((peak, now)) = rss() {
            v["peak_rss_bytes"] = peak.into();
            v["rss_bytes"] = now.into();
        }
        if let Some(p) = &self.plan {
            v["budget_bytes"] = p.budget_bytes.into();
            v["expert_cache_bytes"] = p.cache_bytes.into();
        }
        if let Some(r) = &self.remote {
            v["cluster"] = serde_json::json!({
                "workers": r.status(),
                "wire_bytes": r.wire_bytes(),
                "local_runs": r.fallbacks(),
                "placements": r.placements(),
            });
        }
        if let Some(s) = run {
            v["experts"] = serde_json::to_value(s).expect("stats serialize");
            v["experts"]["hit_rate"] = s.hit_rate().into();
            if let Some(r) = s.lookahead_recall() {
                v["experts"]["lookahead_recall"] = r.into();
            }
        }
        v
    }
}

/// What a user should know of a store's reads: the first file `O_DIRECT` was refused on.
fn io_warnings(store: &StreamingExperts) -> Vec<String> {
    store
        .io_fallbacks()
        .into_iter()
        .take(1)
        .map(|(f, why)| {
            format!(
                "{}: {why}; expert reads go through the page cache",
                f.display()
            )
        })
        .collect()
}

/// What an expert worker holds: a model's routed experts without its dense skeleton.
#[derive(Debug)]
pub struct ExpertHolder {
    pub spec: charm_shared::config::ModelSpec,
    pub executor: Arc<dyn ExpertExecutor>,
    /// The VRAM tier in front of the store, when experts run on a GPU.
    pub vram: Option<Arc<VramExperts>>,
    /// The streaming store behind `executor`, for a container.
    pub store: Option<Arc<StreamingExperts>>,
    /// RAM given to experts, bytes (the cache of a container; every expert for a checkpoint).
    pub ram_bytes: u64,
    /// With int8 activations, the group every expert's gate and up projections quantize their
    /// input in (integer-path int8/int4 weights of one group size), if there is one.
    pub act_group: Option<usize>,
    pub warnings: Vec<String>,
}

/// The one group of `c`'s expert gate/up weights when all are int8/int4 with a group the
/// integer path takes (a multiple of 32).
fn activation_group(c: &Container) -> Option<usize> {
    use charm_shared::container::StoreFormat;
    let mut groups = c.expert_layers().flat_map(|l| [&l.gate, &l.up]).map(|p| {
        matches!(p.format, StoreFormat::Int8 | StoreFormat::Int4)
            .then_some(p.group)
            .flatten()
            .filter(|g| g.is_multiple_of(32))
    });
    let first = groups.next()??;
    groups.all(|g| g == Some(first)).then_some(first)
}

/// RAM a worker keeps beside its expert cache for requests in flight and their intermediates.
const WORKER_WORKING_BYTES: u64 = 256 << 20;

impl Engine {
    /// Loads only the routed experts of the model in `dir` (an expert worker's part): a
    /// container streams them through a cache of what `opts.ram` leaves after the read buffers
    /// and a working margin, holding all of them when they fit; a checkpoint loads them in RAM
    /// (its dense weights are read and dropped). `warm`: read every expert before returning
    /// when they all fit (not for a shard still being fetched).
    pub fn load_experts(
        dir: &Path,
        opts: &EngineOptions,
        warm: bool,
    ) -> Result<ExpertHolder, LoadError> {
        if !Container::is_container(dir) {
            let (spec, src) = open_source(dir)?;
            let model = Model::from_source(spec, &*src, opts.activations)?;
            let mut warnings = Vec::new();
            if opts.ram.is_some() {
                warnings.push(format!("--ram applies to charm containers; {} loads every expert in RAM (convert it to stream experts)", dir.display()));
            }
            return Ok(ExpertHolder {
                spec: model.spec.clone(),
                executor: model.experts.clone(),
                vram: None,
                store: None,
                ram_bytes: model.ram_expert_bytes,
                act_group: None,
                warnings,
            });
        }
        let (spec, c) = crate::model::open_container(dir)?;
        let layers: Vec<_> = c.expert_layers().collect();
        let io = charm_worker::store::io_bytes(&layers, opts.readers.max(1));
        let total: u64 = layers
            .iter()
            .map(|l| l.count as u64 * charm_worker::store::expert_ram_bytes(l))
            .sum();
        let (budget, _) = crate::ops::plan::budget(opts.ram);
        let need = io + WORKER_WORKING_BYTES;
        if budget < need {
            return Err(LoadError::config(
                dir,
                format!(
                    "a RAM budget of {:.2} GiB cannot hold the expert read buffers and working room ({:.2} GiB)",
                    budget as f64 / (1u64 << 30) as f64,
                    need as f64 / (1u64 << 30) as f64
                ),
            ));
        }
        let cache_bytes = (budget - need).min(total);
        let all = warm && cache_bytes >= total;
        let store = StreamingExperts::open(
            &c,
            spec.hidden_size,
            spec.moe_intermediate_size,
            StoreOptions {
                cache_bytes,
                readers: opts.readers,
                direct: opts.direct,
                pin_fraction: if all || !warm { 0.0 } else { opts.pin_fraction },
                history: opts.history_path(dir),
                top_k: spec.router.as_ref().map_or(0, |r| r.top_k),
                activations: opts.activations,
                ..Default::default()
            },
        )
        .map_err(|e| LoadError::config(dir, e.to_string()))?;
        let store = Arc::new(store);
        if all {
            store.warm_all();
        }
        store
            .wait_warm()
            .map_err(|e| LoadError::config(dir, e.to_string()))?;
        let mut warnings = io_warnings(&store);
        let mut executor: Arc<dyn ExpertExecutor> = store.clone();
        let vram = attach_vram(dir, opts, spec.hidden_size, &mut executor, &mut warnings)?;
        Ok(ExpertHolder {
            spec,
            executor,
            vram,
            store: Some(store),
            ram_bytes: cache_bytes,
            act_group: (opts.activations == Activations::Int8)
                .then(|| activation_group(&c))
                .flatten(),
            warnings,
        })
    }
}

/// How much VRAM routed experts may take on each device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum VramBudget {
    Bytes(u64),
    /// The device's free memory less [`VRAM_HEADROOM`] (for the kernels' working buffers,
    /// other programs and the driver).
    Auto,
}

/// What `--vram auto` leaves free on a device: this share of its free memory, at least 1 GiB.
pub const VRAM_HEADROOM: f64 = 0.10;

impl VramBudget {
    /// The bytes this budget gives on `gpu`.
    fn on(self, gpu: &Gpu) -> Result<u64, String> {
        match self {
            Self::Bytes(b) => Ok(b),
            Self::Auto => {
                let free = gpu.free_bytes.ok_or_else(|| {
                    format!(
                        "--vram auto: the driver of {} does not say how much memory is free; give the GiB to use",
                        gpu.name
                    )
                })?;
                let keep = ((free as f64 * VRAM_HEADROOM) as u64).max(1 << 30);
                Ok(free.saturating_sub(keep))
            }
        }
    }
}

/// Moves the dense skeleton to a GPU as `opts.dense_device` says: `gpu` insists (no device, a
/// device that fails its self-check or a model the GPU path does not take is an error), `auto`
/// takes the GPU when all of that holds and the skeleton and the KV cache of the context fit in
/// 90% of its free memory, and says why not otherwise.
fn attach_dense(
    dir: &Path,
    opts: &EngineOptions,
    model: &mut Model,
    warnings: &mut Vec<String>,
) -> Result<(), LoadError> {
    let insist = match opts.dense_device {
        DenseDevice::Cpu => return Ok(()),
        DenseDevice::Gpu => true,
        DenseDevice::Auto => false,
    };
    let refuse = |why: String| -> Result<(), LoadError> {
        if insist {
            Err(LoadError::config(dir, format!("--dense-device gpu: {why}")))
        } else {
            Ok(())
        }
    };
    if let Some(why) = crate::model::gpu::unsupported(model) {
        warnings
            .extend((!insist).then(|| {
                format!("--dense-device auto: {why}; the dense skeleton runs on the CPU")
            }));
        return refuse(why);
    }
    let gpu = match Gpu::open(opts.gpu.first().copied()) {
        Ok(g) => Arc::new(g),
        Err(e) => {
            if !insist {
                warnings.push(format!(
                    "--dense-device auto: {e}; the dense skeleton runs on the CPU"
                ));
            }
            return refuse(e.to_string());
        }
    };
    if !insist {
        let kv = opts.context as u64 * 4 * KvCache::floats_per_token(&model.spec) as u64;
        let need = crate::model::gpu::skeleton_bytes(model) + kv;
        match gpu.free_bytes {
            Some(free) if need <= free / 10 * 9 => {}
            Some(free) => {
                warnings.push(format!(
                    "--dense-device auto: the dense skeleton and the KV cache of {} tokens need {:.2} GiB, more than 90% of the {:.2} GiB free on {}; they stay on the CPU",
                    opts.context,
                    need as f64 / (1u64 << 30) as f64,
                    free as f64 / (1u64 << 30) as f64,
                    gpu.name
                ));
                return Ok(());
            }
            None => {
                warnings.push(format!(
                    "--dense-device auto: the driver of {} does not say how much memory is free; the dense skeleton stays on the CPU (--dense-device gpu puts it there)",
                    gpu.name
                ));
                return Ok(());
            }
        }
    }
    model
        .attach_dense_gpu(gpu)
        .map(|_| ())
        .or_else(|e| refuse(e.to_string()))
}

/// Puts the VRAM tier in front of `experts` when `opts.vram` asks for one: the experts of the
/// container in `dir`, hottest first by its routing history (the rest spread over the layers),
/// while they fit. No usable GPU is a warning and the CPU path; f32 activations are refused (the
/// GPU kernels are the integer path's twins).
fn attach_vram(
    dir: &Path,
    opts: &EngineOptions,
    hidden: usize,
    experts: &mut Arc<dyn ExpertExecutor>,
    warnings: &mut Vec<String>,
) -> Result<Option<Arc<VramExperts>>, LoadError> {
    let Some(budget) = opts.vram else {
        return Ok(None);
    };
    if opts.activations != Activations::Int8 {
        return Err(LoadError::config(
            dir,
            "--vram runs routed experts with int8 activations (the GPU kernels are the integer path's exact twins): add --activations int8".to_string(),
        ));
    }
    if !Container::is_container(dir) || !Container::has_expert_files(dir) {
        warnings.push(format!(
            "--vram applies to charm containers with int8/int4 experts; {} keeps its experts on the CPU (convert it)",
            dir.display()
        ));
        return Ok(None);
    }
    // every adapter asked for (none: the first that passes its self-check); one that fails
    // is left out with a warning
    let ids: Vec<Option<usize>> = if opts.gpu.is_empty() {
        vec![None]
    } else {
        opts.gpu.iter().map(|&i| Some(i)).collect()
    };
    let mut gpus = Vec::new();
    for id in ids {
        match Gpu::open(id) {
            Ok(g) => {
                let b = budget.on(&g).map_err(|m| LoadError::config(dir, m))?;
                gpus.push((Arc::new(g), b));
            }
            Err(e) => warnings.push(format!("{e}; its experts run on the CPU")),
        }
    }
    if gpus.is_empty() {
        return Ok(None);
    }
    let total: u64 = gpus.iter().map(|g| g.1).sum();
    let c = Container::open(dir)?;
    let heat = routing_heat(dir, opts);
    let mut order: Vec<(usize, u32)> = c
        .expert_layers()
        .flat_map(|l| (0..l.count as u32).map(move |e| (l.layer, e)))
        .collect();
    // hottest first; unseen experts by id, then layer, so a partial tier spans every layer
    order.sort_by_key(|&(l, e)| {
        (
            std::cmp::Reverse(heat.get(&(l, e)).copied().unwrap_or(0)),
            e,
            l,
        )
    });
    let tier = VramExperts::new(
        gpus,
        experts.clone(),
        hidden,
        order,
        Box::new(move |l, e| {
            let (gate, up, down) = c.expert(l, e as usize).map_err(|e| e.to_string())?;
            Ok(charm_shared::linear::SwiGlu { gate, up, down })
        }),
        SwapPolicy::default(),
    )
    .map_err(|e| LoadError::config(dir, e.to_string()))?;
    if tier.resident() == 0 {
        warnings.push(format!(
            "--vram: no routed expert fits {:.2} GiB of VRAM; every expert runs on the CPU",
            total as f64 / (1u64 << 30) as f64
        ));
    }
    let tier = Arc::new(tier);
    *experts = tier.clone();
    Ok(Some(tier))
}

/// Uses per `(layer, expert)` from the routing history of a container, for placement.
fn routing_heat(dir: &Path, opts: &EngineOptions) -> std::collections::HashMap<(usize, u32), u64> {
    let Some(path) = opts.history_path(dir) else {
        return Default::default();
    };
    let Ok(c) = Container::open(dir) else {
        return Default::default();
    };
    match charm_worker::history::History::load_for(&path, &c) {
        Ok(Some(h)) => h
            .ranked()
            .into_iter()
            .map(|(l, e, n)| ((l, e), n))
            .collect(),
        _ => Default::default(),
    }
}

/// One line of [`Engine::run_stats`].
pub fn render_stats(run: Option<&ExpertStats>) -> String {
    let mut s = String::new();
    if let Some(st) = run {
        s += &format!(
            "experts: hit rate {:.1}%, {:.2} GB read in {} reads, waited {:.2}s on disk, computed {:.2}s",
            100.0 * st.hit_rate(),
            st.bytes_read as f64 / 1e9,
            st.reads,
            st.wait_seconds,
            st.compute_seconds
        );
        if let Some(r) = st.lookahead_recall() {
            s += &format!(", lookahead recall {:.1}%", 100.0 * r);
        }
        if st.vram_experts > 0 {
            s += &format!(
                ", {} expert uses on the GPU ({} experts in {:.2} GiB of VRAM, {} moved in)",
                st.vram_hits,
                st.vram_experts,
                st.vram_bytes as f64 / (1u64 << 30) as f64,
                st.vram_swaps
            );
        }
        s += "; ";
    }
    if let Some((peak, _)) = rss() {
        s += &format!("peak RSS {:.2} GiB", peak as f64 / (1u64 << 30) as f64);
    }
    s
}
