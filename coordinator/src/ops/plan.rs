//! Memory planning for single-box mode: from a container's metadata alone, how much RAM the dense
//! skeleton, the KV cache, the I/O buffers and the working set take, how many routed experts the
//! rest of the budget caches, and what a token will then cost in disk reads.

use std::path::{Path, PathBuf};

use charm_shared::arch::names;
use charm_shared::checkpoint::Checkpoint;
use charm_shared::config::ModelSpec;
use charm_shared::container::{Container, ExpertLayer, Part, Policy, StoreFormat};
use charm_shared::LoadError;
use charm_worker::history::History;
use charm_worker::store::{expert_ram_bytes, io_bytes};
use serde::Serialize;

use crate::model::cache::KvCache;

const GIB: f64 = (1u64 << 30) as f64;

/// Memory the system reports, from `/proc/meminfo`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
}

/// The `NAME:   123 kB` field of a `/proc` status file, in bytes.
fn kb_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kb: u64 = line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// `MemTotal` and `MemAvailable`, where the system has them.
pub fn meminfo() -> Option<MemInfo> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    Some(MemInfo {
        total: kb_field(&text, "MemTotal:")?,
        available: kb_field(&text, "MemAvailable:")?,
    })
}

/// The RAM budget: `ram` when given (`"--ram"`), else what is available less a margin for the
/// system, 5% and at least 512 MiB (`"MemAvailable"`; 0 where the system does not say).
pub fn budget(ram: Option<u64>) -> (u64, &'static str) {
    match ram {
        Some(r) => (r, "--ram"),
        None => (
            meminfo().map_or(0, |m| {
                m.available
                    .saturating_sub((m.available / 20).max(512 << 20))
            }),
            "MemAvailable",
        ),
    }
}

/// Peak and current resident set size of this process (`VmHWM`, `VmRSS`), in bytes.
pub fn rss() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    Some((kb_field(&text, "VmHWM:")?, kb_field(&text, "VmRSS:")?))
}

/// What the planner may assume or was told.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// `--ram` in bytes; `None`: from `MemAvailable`.
    pub ram: Option<u64>,
    /// Context tokens to reserve KV cache for.
    pub context: usize,
    /// Tokens of the longest prefill step (activations scale with it).
    pub batch_tokens: usize,
    pub readers: usize,
    /// Share of the cache for pinned experts.
    pub pin_fraction: f64,
    /// Routing history to estimate hit rates from (optional).
    pub history: Option<PathBuf>,
    /// Assumed sequential read speed of the disk and memory read bandwidth, bytes/s (for the
    /// predicted bottleneck; `charm doctor` and `charm iobench` measure the disk).
    pub disk_bytes_s: f64,
    pub mem_bytes_s: f64,
    /// Storage formats assumed for a checkpoint directory (what `charm convert` would write); a
    /// container's own formats are used for a container.
    pub policy: Policy,
    /// The dense pass runs on a discrete GPU (`--dense-device gpu`): once loaded and checked
    /// there, the dense weights' CPU copies are freed and the expert cache takes their room.
    /// The engine opens its store without it and grows it after the move (the copies are in RAM
    /// while they load).
    pub dense_on_gpu: bool,
}

impl Default for PlanInput {
    fn default() -> Self {
        Self {
            ram: None,
            context: 4096,
            batch_tokens: 512,
            readers: 4,
            pin_fraction: 0.5,
            history: None,
            disk_bytes_s: 2.0e9,
            mem_bytes_s: 20.0e9,
            policy: Policy::default(),
            dense_on_gpu: false,
        }
    }
}

/// The plan for one model on this machine.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub model: PathBuf,
    /// `"container"`; `"checkpoint"`: a Hugging Face checkpoint planned as `charm convert`
    /// would store it with `formats`; `"config"`: the same from `config.json` alone (the tensor
    /// shapes the architecture names).
    pub source: &'static str,
    /// Storage formats of the routed experts, dense weights, embeddings, MTP layer.
    pub formats: Policy,
    /// Disk space of the container (for a checkpoint: once converted).
    pub container_bytes: u64,
    pub budget_bytes: u64,
    /// `"--ram"` or `"MemAvailable"`.
    pub budget_source: &'static str,
    pub mem_available_bytes: Option<u64>,
    /// Dense skeleton as held in RAM (decoded formats), and of it the embedding table (what
    /// stays in RAM when the dense pass runs on a GPU: the token lookup is the CPU's).
    pub dense_bytes: u64,
    pub embed_bytes: u64,
    pub kv_bytes: u64,
    pub context_tokens: usize,
    pub io_bytes: u64,
    pub working_bytes: u64,
    /// Dense + KV + I/O + working set: what must fit before any expert is cached.
    pub resident_bytes: u64,
    pub moe_layers: usize,
    /// Decoder layers with a dense feed-forward (no routed experts).
    pub dense_layers: usize,
    /// Layers with routed experts in the container (the MoE layers, plus the MTP layer's).
    pub expert_layers: usize,
    pub experts_per_layer: usize,
    pub top_k: usize,
    pub expert_bytes: u64,
    pub experts_total_bytes: u64,
    /// RAM left for the expert cache (0 when the model does not fit); with `dense_on_gpu`, once
    /// the dense weights' CPU copies are freed.
    pub cache_bytes: u64,
    /// Planned for the dense pass on a discrete GPU ([`PlanInput::dense_on_gpu`]).
    pub dense_on_gpu: bool,
    pub cache_experts: u64,
    pub cache_experts_per_layer: f64,
    pub pinned_experts: u64,
    /// Every expert fits: loaded at start, no disk reads while generating.
    pub all_resident: bool,
    /// Routed expert bytes one token uses (`top_k` per MoE layer).
    pub active_expert_bytes_per_token: u64,
    /// Expected share of expert uses served from RAM: from the routing history when there is
    /// one, else assuming uniform routing (`cache / total`).
    pub expected_hit_rate: f64,
    pub hit_rate_source: &'static str,
    pub expected_cold_bytes_per_token: u64,
    /// Bytes read from RAM per token (dense skeleton minus the embedding table, plus the cached
    /// share of experts; with `dense_on_gpu` the experts only).
    pub resident_read_bytes_per_token: u64,
    /// Of the dense skeleton, bytes one token reads (all but the embedding table), of it one MoE
    /// layer's shared expert, and what one MTP draft reads (its layer, `top_k` of its experts,
    /// an output head).
    pub dense_read_bytes_per_token: u64,
    pub shared_read_bytes_per_layer: u64,
    pub mtp_read_bytes_per_draft: u64,
    pub disk_seconds_per_token: f64,
    pub memory_seconds_per_token: f64,
    /// `"disk"` or `"memory bandwidth"`.
    pub bottleneck: &'static str,
    pub assumed_disk_gb_s: f64,
    pub assumed_mem_gb_s: f64,
    /// Whether the model can run in this budget.
    pub fits: bool,
    /// Least budget that runs it (resident part plus room for the minimum expert cache).
    pub min_budget_bytes: u64,
}

/// RAM one dense tensor takes once loaded: quantized formats as stored, except the tensors the
/// forward pass keeps as f32 (1-D vectors, routers, indexer `weights_proj`) and bf16 rows whose
/// width is not a multiple of 8.
fn dense_ram(name: &str, p: &Part) -> u64 {
    let n: u64 = p.shape.iter().map(|&d| d as u64).product();
    // the loader multiplies these in f32 whatever their storage (see `model::Loader::mat`)
    let f32_kept =
        p.shape.len() == 1 || names::classify(name, usize::MAX).kind == names::Kind::Exact;
    let odd_bf16 = p.format == StoreFormat::Bf16 && p.shape.last().is_none_or(|c| c % 8 != 0);
    if f32_kept || odd_bf16 || p.format == StoreFormat::F32 {
        4 * n
    } else {
        p.data[1] + p.scales.map_or(0, |s| s[1]) + p.mins.map_or(0, |m| m[1])
    }
}

/// Plans `dir` with `input`: a charm container, or a Hugging Face checkpoint as `charm convert`
/// would store it with `input.policy`. Reads only metadata (for a checkpoint, the safetensors
/// headers).
pub fn plan(dir: &Path, input: &PlanInput) -> Result<Plan, LoadError> {
    if !Container::is_container(dir) && dir.join("config.json").is_file() {
        let spec = ModelSpec::from_dir(dir)?;
        let (source, l) = if has_safetensors(dir) {
            let ck = Checkpoint::open(dir).map_err(|e| {
                LoadError::config(
                    dir,
                    format!(
                        "neither a charm container nor a checkpoint with its safetensors files ({e})"
                    ),
                )
            })?;
            (
                "checkpoint",
                crate::ops::convert::layout(&spec, &ck, &input.policy),
            )
        } else {
            (
                "config",
                crate::ops::convert::layout_from_spec(&spec, &input.policy),
            )
        };
        let l = l.map_err(|e| LoadError::config(dir, e.to_string()))?;
        let model = Stored {
            dir,
            spec: &spec,
            source,
            formats: input.policy.clone(),
            dense_file_bytes: l.dense_bytes,
            dense: l.dense.iter().map(|(n, p)| (n.as_str(), p)).collect(),
            experts: l.experts.iter().collect(),
            history: None,
        };
        return Ok(model.plan(input));
    }
    let (spec, c) = crate::model::open_container(dir)?;
    plan_container(dir, &spec, &c, input)
}

/// Whether `dir` holds any `.safetensors` file (else a `config.json` alone is planned from the
/// architecture's tensor shapes).
fn has_safetensors(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
    })
}

/// [`plan`] for an opened container.
pub fn plan_container(
    dir: &Path,
    spec: &ModelSpec,
    c: &Container,
    input: &PlanInput,
) -> Result<Plan, LoadError> {
    let m = &c.manifest;
    let history = match &input.history {
        Some(p) => History::load_for(p, c).map_err(|e| LoadError::config(e.path(), e.reason()))?,
        None => None,
    };
    let model = Stored {
        dir,
        spec,
        source: "container",
        formats: m.policy.clone(),
        dense_file_bytes: c.dense_bytes(),
        dense: m
            .tensors
            .iter()
            .map(|(n, t)| (n.as_str(), &t.part))
            .collect(),
        experts: c.expert_layers().collect(),
        history,
    };
    Ok(model.plan(input))
}

/// What planning needs to know of a model: its config, dense tensors and expert layers as stored.
struct Stored<'a> {
    dir: &'a Path,
    spec: &'a ModelSpec,
    source: &'static str,
    formats: Policy,
    /// Length of the dense file.
    dense_file_bytes: u64,
    dense: Vec<(&'a str, &'a Part)>,
    experts: Vec<&'a ExpertLayer>,
    history: Option<History>,
}

impl Stored<'_> {
    fn plan(self, input: &PlanInput) -> Plan {
        let (dir, spec) = (self.dir, self.spec);
        let dense_bytes: u64 = self.dense.iter().map(|(n, p)| dense_ram(n, p)).sum();
        // Generation reserves the KV cache for its full context up front (no growth doubling).
        let layers = &self.experts;
        let n_main = spec.layers.len();
        let mtp_layer = layers.iter().find(|l| l.layer >= n_main);
        // (the MTP layer's own cache only where the model carries the layer)
        let mtp = if mtp_layer.is_some() { mtp_kv(spec) } else { 0 };
        let kv_bytes = 4 * (KvCache::floats_per_token(spec) as u64 + mtp) * input.context as u64;
        let io = io_bytes(layers, input.readers);
        let (h, i) = (spec.hidden_size as u64, spec.moe_intermediate_size as u64);
        let top_k = spec.router.as_ref().map_or(0, |r| r.top_k);
        let vocab = spec.vocab_size as u64;
        let b = input.batch_tokens.max(1) as u64;
        let heads_width = match &spec.attention {
            charm_shared::config::AttentionSpec::Mla(m) => {
                (m.n_heads * (m.qk_head_dim() + m.kv_lora_rank + m.v_head_dim)) as u64
            }
            charm_shared::config::AttentionSpec::Gqa(g) => (3 * g.n_heads * g.head_dim) as u64,
        };
        // Activations of a step: residual and norms, attention and MLP intermediates, routed-expert
        // slot outputs, one row of logits; plus the allocator and thread stacks.
        let working_bytes = 4 * b * (16 * h + 4 * i + 2 * top_k as u64 * h + 4 * heads_width)
            + 4 * vocab * 2
            + (96 << 20);
        let expert_bytes = layers
            .iter()
            .map(|l| expert_ram_bytes(l))
            .max()
            .unwrap_or(0);
        let experts_total: u64 = layers.iter().map(|l| l.count as u64).sum();
        let experts_total_bytes = layers
            .iter()
            .map(|l| l.count as u64 * expert_ram_bytes(l))
            .sum::<u64>();
        let tensor = |name: &str| self.dense.iter().find(|(n, _)| *n == name).map(|(_, p)| *p);
        // the embedding table is read one row per token; it is resident but not streamed per token
        let embed = tensor(names::EMBED).map_or(0, |p| dense_ram(names::EMBED, p));
        // a tied head reads the embedding table whole every token
        let tied = spec.tie_word_embeddings && tensor(names::HEAD).is_none();
        let resident_bytes = dense_bytes + kv_bytes + io + working_bytes;
        let mem = meminfo();
        let (budget, source) = budget(input.ram);
        // With no cache at all every expert streams through the I/O working set: slow, still exact.
        let min_budget_bytes = resident_bytes;
        let fits = budget >= min_budget_bytes;
        // with the dense pass on a GPU, the room its CPU copies leave once they are freed
        let freed = if input.dense_on_gpu {
            dense_bytes.saturating_sub(embed)
        } else {
            0
        };
        let cache_bytes = if fits {
            (budget - resident_bytes + freed).min(experts_total_bytes)
        } else {
            0
        };
        // Every expert fits when their bytes do (layers may differ in expert size: an MTP
        // layer's experts have its own format); otherwise count the cache in the largest experts.
        let all_resident = fits && budget - resident_bytes + freed >= experts_total_bytes;
        let cache_experts = if all_resident {
            experts_total
        } else {
            cache_bytes.checked_div(expert_bytes).unwrap_or(0)
        };
        let pinned = if all_resident {
            0
        } else {
            (cache_experts as f64 * input.pin_fraction.clamp(0.0, 1.0)) as u64
        };
        let moe_layers = spec
            .layers
            .iter()
            .filter(|l| l.mlp == charm_shared::config::MlpKind::Moe)
            .count();
        // (the MTP layer's experts run only when drafting)
        let active = top_k as u64
            * layers
                .iter()
                .filter(|l| l.layer < spec.layers.len())
                .map(|l| expert_ram_bytes(l))
                .sum::<u64>();
        // Expected hit rate: the cached experts are the most-used ones (pinning plus frequency-aware
        // replacement), so with a history the hit rate is the usage share of the top `cache_experts`.
        let ranked = self
            .history
            .as_ref()
            .map(History::ranked)
            .unwrap_or_default();
        let total: u64 = ranked.iter().map(|x| x.2).sum();
        let (hit, hit_source) = if all_resident {
            (1.0, "all experts resident")
        } else if total > 0 {
            let top: u64 = ranked
                .iter()
                .take(cache_experts as usize)
                .map(|x| x.2)
                .sum();
            (top as f64 / total as f64, "routing history")
        } else {
            (
                (cache_experts as f64 / experts_total.max(1) as f64).min(1.0),
                "uniform routing assumed",
            )
        };
        let cold = (active as f64 * (1.0 - hit)) as u64;
        let dense_read = dense_bytes.saturating_sub(embed) + if tied { embed } else { 0 };
        // (the dense pass on a GPU reads its weights from VRAM)
        let dense_ram_read = if input.dense_on_gpu { 0 } else { dense_read };
        let resident_read = dense_ram_read + (active as f64 * hit) as u64;
        let main_tensor = |n: &str| !names::classify(n, n_main).mtp;
        let shared: u64 = self
            .dense
            .iter()
            .filter(|(n, _)| main_tensor(n) && n.contains(".shared_experts."))
            .map(|(n, p)| dense_ram(n, p))
            .sum();
        let mtp_all: u64 = self
            .dense
            .iter()
            .filter(|(n, _)| !main_tensor(n))
            .map(|(n, p)| dense_ram(n, p))
            .sum();
        let mtp_read = mtp_layer.map_or(0, |l| {
            let own: u64 = self
                .dense
                .iter()
                .filter(|(n, _)| {
                    let c = names::classify(n, n_main);
                    c.mtp && c.kind != names::Kind::Embedding && c.kind != names::Kind::Head
                })
                .map(|(n, p)| dense_ram(n, p))
                .sum();
            let head = tensor(names::HEAD)
                .map(|p| dense_ram(names::HEAD, p))
                .unwrap_or(embed);
            own + head + top_k as u64 * expert_ram_bytes(l)
        });
        let disk_s = cold as f64 / input.disk_bytes_s;
        let mem_s = resident_read as f64 / input.mem_bytes_s;
        Plan {
            model: dir.to_path_buf(),
            source: self.source,
            formats: self.formats,
            container_bytes: self.dense_file_bytes
                + layers
                    .iter()
                    .map(|l| l.count as u64 * l.record_bytes)
                    .sum::<u64>(),
            budget_bytes: budget,
            budget_source: source,
            mem_available_bytes: mem.map(|m| m.available),
            dense_bytes,
            embed_bytes: embed,
            kv_bytes,
            context_tokens: input.context,
            io_bytes: io,
            working_bytes,
            resident_bytes,
            moe_layers,
            dense_layers: spec.layers.len() - moe_layers,
            expert_layers: layers.len(),
            experts_per_layer: spec.router.as_ref().map_or(0, |r| r.n_experts),
            top_k,
            expert_bytes,
            experts_total_bytes,
            cache_bytes,
            dense_on_gpu: input.dense_on_gpu,
            cache_experts,
            cache_experts_per_layer: if layers.is_empty() {
                0.0
            } else {
                cache_experts as f64 / layers.len() as f64
            },
            pinned_experts: pinned,
            all_resident,
            active_expert_bytes_per_token: active,
            expected_hit_rate: hit,
            hit_rate_source: hit_source,
            expected_cold_bytes_per_token: cold,
            resident_read_bytes_per_token: resident_read,
            dense_read_bytes_per_token: dense_read.saturating_sub(mtp_all),
            shared_read_bytes_per_layer: shared / moe_layers.max(1) as u64,
            mtp_read_bytes_per_draft: mtp_read,
            disk_seconds_per_token: disk_s,
            memory_seconds_per_token: mem_s,
            bottleneck: if disk_s > mem_s {
                "disk"
            } else {
                "memory bandwidth"
            },
            assumed_disk_gb_s: input.disk_bytes_s / 1e9,
            assumed_mem_gb_s: input.mem_bytes_s / 1e9,
            fits,
            min_budget_bytes,
        }
    }
}

/// KV floats per token of the MTP layer (it keeps its own one-layer cache when drafting).
fn mtp_kv(spec: &ModelSpec) -> u64 {
    if spec.mtp_layers == 0 {
        return 0;
    }
    let n = spec.layers.len().max(1) as u64;
    KvCache::floats_per_token(spec) as u64 / n
}

impl Plan {
    /// Why the model cannot run in the budget, with what would.
    pub fn refusal(&self) -> String {
        format!(
            "the model does not fit in {} ({}): the dense skeleton takes {}, the KV cache for {} tokens {}, I/O buffers {} and the working set {}; it needs --ram {:.2} (GiB) or more{}",
            human(self.budget_bytes),
            self.budget_source,
            human(self.dense_bytes),
            self.context_tokens,
            human(self.kv_bytes),
            human(self.io_bytes),
            human(self.working_bytes),
            (self.min_budget_bytes as f64 / GIB * 100.0).ceil() / 100.0,
            if self.kv_bytes > 0 { " (or a shorter context)" } else { "" }
        )
    }

    /// The human-readable plan.
    pub fn render(&self) -> String {
        let g = |b: u64| human(b);
        let mut s = String::new();
        s += &format!("model            {}\n", self.model.display());
        let f = &self.formats;
        let formats = format!(
            "experts {}, dense {}, embedding {}, MTP {}, groups of {}",
            f.experts.name(),
            f.dense.name(),
            f.embedding.name(),
            f.mtp.name(),
            f.group
        );
        s += &if self.source == "config" {
            format!(
                "config.json      planned from the architecture's shapes as `charm convert` would store it ({formats}): {} on disk\n",
                g(self.container_bytes)
            )
        } else if self.source == "checkpoint" {
            format!(
                "checkpoint       planned as `charm convert` would store it ({formats}): {} on disk\n",
                g(self.container_bytes)
            )
        } else {
            format!(
                "container        {} on disk ({formats})\n",
                g(self.container_bytes)
            )
        };
        s += &format!(
            "budget           {} ({})\n",
            g(self.budget_bytes),
            self.budget_source
        );
        s += &format!("dense skeleton   {}\n", g(self.dense_bytes));
        s += &format!(
            "KV cache         {} for {} tokens\n",
            g(self.kv_bytes),
            self.context_tokens
        );
        s += &format!("I/O buffers      {}\n", g(self.io_bytes));
        s += &format!("working set      {}\n", g(self.working_bytes));
        s += &format!(
            "routed experts   {} layers x {} experts{}, up to {} each = {}\n",
            self.expert_layers,
            self.experts_per_layer,
            if self.expert_layers > self.moe_layers {
                " (MoE layers and the MTP layer)"
            } else {
                ""
            },
            g(self.expert_bytes),
            g(self.experts_total_bytes)
        );
        if !self.fits {
            s += &format!("does not fit: {}\n", self.refusal());
            return s;
        }
        s += &format!(
            "expert cache     {} = {} experts ({:.1} per layer), {} pinned{}{}\n",
            g(self.cache_bytes),
            self.cache_experts,
            self.cache_experts_per_layer,
            self.pinned_experts,
            if self.all_resident {
                "; every expert resident"
            } else {
                ""
            },
            if self.dense_on_gpu {
                "; with the dense pass on the GPU (the dense weights leave RAM once loaded there, all but the embedding table)"
            } else {
                ""
            }
        );
        s += &format!(
            "per token        {} of experts; expected hit rate {:.1}% ({}); {} cold from disk\n",
            g(self.active_expert_bytes_per_token),
            100.0 * self.expected_hit_rate,
            self.hit_rate_source,
            g(self.expected_cold_bytes_per_token)
        );
        s += &format!(
            "bottleneck       {} (disk {:.3} s/token at {:.1} GB/s, memory {:.3} s/token at {:.1} GB/s; assumed speeds, `charm doctor` measures the disk)\n",
            self.bottleneck,
            self.disk_seconds_per_token,
            self.assumed_disk_gb_s,
            self.memory_seconds_per_token,
            self.assumed_mem_gb_s
        );
        s
    }
}

/// Bytes in the largest binary unit that keeps the number at least 1.
pub fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}
