//! Parameter and byte accounting for `charm info`: from checkpoint headers when weights are
//! present (no tensor data is read), or from config.json alone.

use std::collections::BTreeMap;
use std::path::Path;

use charm_shared::arch::names::{self, Kind};
use charm_shared::checkpoint::Checkpoint;
use charm_shared::config::{AttentionSpec, IndexerKind, MlpKind, ModelSpec};
use charm_shared::LoadError;

use crate::model::cache::KvCache;
use crate::ops::plan::human;

/// Where a tensor belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Category {
    /// Resident every token: attention, norms, routers, shared experts, dense MLPs.
    Dense,
    /// Routed experts of the main layers.
    Routed,
    /// Token embedding table (one row read per token).
    Embedding,
    /// Output head.
    Head,
    /// Multi-token-prediction layers.
    Mtp,
}

/// Classifies a checkpoint tensor name.
pub fn classify(name: &str, n_layers: usize) -> Category {
    let c = names::classify(name, n_layers);
    match c.kind {
        _ if c.mtp => Category::Mtp,
        Kind::Routed => Category::Routed,
        Kind::Embedding if c.layer.is_none() => Category::Embedding,
        Kind::Head if c.layer.is_none() => Category::Head,
        _ => Category::Dense,
    }
}

/// Parameter counts and bytes per part.
#[derive(Debug, Clone, Default)]
pub struct Accounting {
    pub params: BTreeMap<Category, u64>,
    pub bytes: BTreeMap<Category, u64>,
    /// Bytes per storage dtype (checkpoint only).
    pub dtype_bytes: BTreeMap<String, u64>,
    /// Bytes one decoded token reads: dense + head + one embedding row + its share of routed experts.
    pub active_bytes_per_token: u64,
    pub active_params_per_token: u64,
}

impl Accounting {
    /// From checkpoint headers.
    pub fn from_checkpoint(spec: &ModelSpec, ck: &Checkpoint) -> Self {
        let mut a = Accounting::default();
        for name in ck.names() {
            let (info, _) = ck.info(name).expect("listed tensor");
            let part = classify(name, spec.layers.len());
            *a.params.entry(part).or_insert(0) += info.numel() as u64;
            *a.bytes.entry(part).or_insert(0) += (info.end - info.begin) as u64;
        }
        for (d, b) in ck.bytes_per_dtype() {
            a.dtype_bytes.insert(d.name().to_string(), b);
        }
        a.finish(spec);
        a
    }

    /// From config.json alone, assuming `bytes_per_param` storage.
    pub fn from_spec(spec: &ModelSpec, bytes_per_param: f64) -> Self {
        let h = spec.hidden_size as u64;
        let mut a = Accounting::default();
        let mut add = |p: Category, n: u64| {
            *a.params.entry(p).or_insert(0) += n;
        };
        let attn: u64 = match &spec.attention {
            AttentionSpec::Mla(m) => {
                let (nh, qk) = (m.n_heads as u64, m.qk_head_dim() as u64);
                let q = match m.q_lora_rank {
                    Some(r) => h * r as u64 + r as u64 + r as u64 * nh * qk,
                    None => h * nh * qk,
                };
                q + h * m.cache_width() as u64
                    + m.kv_lora_rank as u64
                    + m.kv_lora_rank as u64 * nh * (m.qk_nope_head_dim + m.v_head_dim) as u64
                    + nh * m.v_head_dim as u64 * h
            }
            AttentionSpec::Gqa(g) => {
                let (q, kv) = (
                    (g.n_heads * g.head_dim) as u64,
                    (g.n_kv_heads * g.head_dim) as u64,
                );
                2 * h * q + 2 * h * kv + if g.qk_norm { 2 * g.head_dim as u64 } else { 0 }
            }
        };
        let indexer = spec.dsa.as_ref().map_or(0, |d| {
            let qr = match &spec.attention {
                AttentionSpec::Mla(m) => m.q_lora_rank.unwrap_or(spec.hidden_size) as u64,
                _ => h,
            };
            (d.n_heads * d.head_dim) as u64 * qr
                + d.head_dim as u64 * h
                + 2 * d.head_dim as u64
                + d.n_heads as u64 * h
        });
        let mi = spec.moe_intermediate_size as u64;
        for l in &spec.layers {
            add(Category::Dense, attn + 2 * h);
            if l.indexer == Some(IndexerKind::Full) {
                add(Category::Dense, indexer);
            }
            match l.mlp {
                MlpKind::Dense => add(Category::Dense, 3 * h * spec.intermediate_size as u64),
                MlpKind::Moe => {
                    let r = spec.router.as_ref().expect("validated");
                    add(
                        Category::Dense,
                        r.n_experts as u64 * (h + 1) + 3 * h * mi * spec.n_shared_experts as u64,
                    );
                    add(Category::Routed, r.n_experts as u64 * 3 * h * mi);
                }
            }
        }
        add(Category::Dense, h);
        if spec.mtp_layers > 0 {
            // Each MTP layer: one sparse decoder layer (with its own indexer) plus eh_proj and the
            // enorm / hnorm / head norms; its embedding and head are counted as shared.
            let r = spec
                .router
                .as_ref()
                .map_or(0, |r| r.n_experts as u64 * (h + 1 + 3 * h * mi));
            let one = attn
                + 2 * h
                + indexer
                + r
                + 3 * h * mi * spec.n_shared_experts as u64
                + 2 * h * h
                + 3 * h;
            add(Category::Mtp, one * spec.mtp_layers as u64);
        }
        add(Category::Embedding, spec.vocab_size as u64 * h);
        if !spec.tie_word_embeddings {
            add(Category::Head, spec.vocab_size as u64 * h);
        }
        for (p, n) in a.params.clone() {
            a.bytes.insert(p, (n as f64 * bytes_per_param) as u64);
        }
        a.finish(spec);
        a
    }

    fn finish(&mut self, spec: &ModelSpec) {
        let get = |m: &BTreeMap<Category, u64>, p| m.get(&p).copied().unwrap_or(0);
        let frac = spec
            .router
            .as_ref()
            .map_or(0.0, |r| r.top_k as f64 / r.n_experts as f64);
        let row =
            |m: &BTreeMap<Category, u64>| get(m, Category::Embedding) / spec.vocab_size as u64;
        self.active_bytes_per_token = get(&self.bytes, Category::Dense)
            + get(&self.bytes, Category::Head)
            + row(&self.bytes)
            + (get(&self.bytes, Category::Routed) as f64 * frac) as u64;
        self.active_params_per_token = get(&self.params, Category::Dense)
            + get(&self.params, Category::Head)
            + row(&self.params)
            + (get(&self.params, Category::Routed) as f64 * frac) as u64;
    }

    pub fn total_params(&self) -> u64 {
        self.params.values().sum()
    }
}

/// What `charm info` shows about a model directory: architecture, parameters and bytes per part,
/// active bytes per token, KV cache per token.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub spec: ModelSpec,
    pub accounting: Accounting,
    /// Where the figures come from (checkpoint headers, or config.json alone).
    pub source: &'static str,
}

/// The parts in the order `charm info` lists them, with their JSON names.
const PARTS: [(&str, Category); 5] = [
    ("dense", Category::Dense),
    ("routed_experts", Category::Routed),
    ("embedding", Category::Embedding),
    ("head", Category::Head),
    ("mtp", Category::Mtp),
];

impl ModelInfo {
    /// Reads `dir`: from its safetensors headers when it has weights (no tensor data is read),
    /// else from `config.json` alone (bf16 assumed).
    pub fn read(dir: &Path) -> Result<Self, LoadError> {
        let spec = ModelSpec::from_dir(dir)?;
        let has_weights = std::fs::read_dir(dir)
            .map_err(|source| LoadError::Io {
                path: dir.to_path_buf(),
                source,
            })?
            .filter_map(|e| e.ok())
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
        let (accounting, source) = if has_weights {
            let ck = Checkpoint::open(dir)?;
            (
                Accounting::from_checkpoint(&spec, &ck),
                "checkpoint headers",
            )
        } else {
            (
                Accounting::from_spec(&spec, 2.0),
                "config.json only (bf16 assumed)",
            )
        };
        Ok(Self {
            spec,
            accounting,
            source,
        })
    }

    fn part(m: &BTreeMap<Category, u64>, p: Category) -> u64 {
        m.get(&p).copied().unwrap_or(0)
    }

    fn attention(&self) -> String {
        match &self.spec.attention {
            AttentionSpec::Mla(m) => format!(
                "MLA (heads {}, q_lora {:?}, kv_lora {}, rope {}, v {})",
                m.n_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim
            ),
            AttentionSpec::Gqa(q) => format!(
                "GQA (heads {}, kv heads {}, head dim {})",
                q.n_heads, q.n_kv_heads, q.head_dim
            ),
        }
    }

    fn router(&self) -> Option<String> {
        self.spec.router.as_ref().map(|r| {
            format!(
                "{:?} {} experts top-{} (groups {}/{}), scale {}",
                r.scoring, r.n_experts, r.top_k, r.topk_group, r.n_group, r.routed_scaling_factor
            )
        })
    }

    fn kv_bytes_per_token(&self) -> usize {
        KvCache::floats_per_token(&self.spec) * 4
    }

    /// The JSON `charm info --json` prints.
    pub fn to_json(&self) -> serde_json::Value {
        let (spec, acc) = (&self.spec, &self.accounting);
        let mut p = serde_json::Map::new();
        let mut b = serde_json::Map::new();
        for (n, part) in PARTS {
            p.insert(n.into(), Self::part(&acc.params, part).into());
            b.insert(n.into(), Self::part(&acc.bytes, part).into());
        }
        serde_json::json!({
            "architecture": spec.arch.model_type(),
            "source": self.source,
            "layers": spec.layers.len(),
            "moe_layers": spec.moe_layers(),
            "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size,
            "attention": self.attention(),
            "router": self.router(),
            "dsa_index_topk": spec.dsa.as_ref().map(|d| d.topk),
            "mtp_layers": spec.mtp_layers,
            "params": p,
            "total_params": acc.total_params(),
            "bytes": b,
            "bytes_per_dtype": acc.dtype_bytes,
            "active_params_per_token": acc.active_params_per_token,
            "active_bytes_per_token": acc.active_bytes_per_token,
            "kv_cache_bytes_per_token_f32": self.kv_bytes_per_token(),
        })
    }

    /// The text `charm info` prints.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let (spec, acc) = (&self.spec, &self.accounting);
        let mut s = String::new();
        let _ = writeln!(s, "architecture   {}", spec.arch.model_type());
        let _ = writeln!(s, "source         {}", self.source);
        let _ = writeln!(
            s,
            "layers         {} ({} MoE), hidden {}, vocab {}",
            spec.layers.len(),
            spec.moe_layers(),
            spec.hidden_size,
            spec.vocab_size
        );
        let _ = writeln!(s, "attention      {}", self.attention());
        if let Some(d) = &spec.dsa {
            let _ = writeln!(
                s,
                "sparse attn    DSA indexer: {} heads x {}, top-{} keys",
                d.n_heads, d.head_dim, d.topk
            );
        }
        if let Some(r) = self.router() {
            let _ = writeln!(s, "router         {r}");
        }
        let _ = writeln!(s, "mtp layers     {}", spec.mtp_layers);
        let _ = writeln!(
            s,
            "parameters     {:.3} B total",
            acc.total_params() as f64 / 1e9
        );
        for (n, part) in PARTS {
            let _ = writeln!(
                s,
                "  {n:<15} {:>16} params  {:>12}",
                Self::part(&acc.params, part),
                human(Self::part(&acc.bytes, part))
            );
        }
        if !acc.dtype_bytes.is_empty() {
            let _ = writeln!(s, "bytes per dtype");
            for (d, b) in &acc.dtype_bytes {
                let _ = writeln!(s, "  {d:<15} {:>12}", human(*b));
            }
        }
        let _ = writeln!(
            s,
            "active/token   {:.3} B params, {} read per decoded token",
            acc.active_params_per_token as f64 / 1e9,
            human(acc.active_bytes_per_token)
        );
        let _ = writeln!(
            s,
            "kv cache       {} per token (f32)",
            human(self.kv_bytes_per_token() as u64)
        );
        s
    }
}
