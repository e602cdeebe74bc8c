//! Parameter and byte accounting for `charm info`: from checkpoint headers when weights are
//! present (no tensor data is read), or from config.json alone.

use std::collections::BTreeMap;

use charm_shared::checkpoint::Checkpoint;
use charm_shared::config::{AttentionSpec, IndexerKind, MlpKind, ModelSpec};

/// Where a tensor belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
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
pub fn classify(name: &str, n_layers: usize) -> Part {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        let idx: usize = rest
            .split('.')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if idx >= n_layers {
            return Part::Mtp;
        }
        if rest.contains(".mlp.experts.") {
            return Part::Routed;
        }
        return Part::Dense;
    }
    match name {
        "model.embed_tokens.weight" => Part::Embedding,
        "lm_head.weight" => Part::Head,
        _ => Part::Dense,
    }
}

/// Parameter counts and bytes per part.
#[derive(Debug, Clone, Default)]
pub struct Accounting {
    pub params: BTreeMap<Part, u64>,
    pub bytes: BTreeMap<Part, u64>,
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
        let mut add = |p: Part, n: u64| {
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
            add(Part::Dense, attn + 2 * h);
            if l.indexer == Some(IndexerKind::Full) {
                add(Part::Dense, indexer);
            }
            match l.mlp {
                MlpKind::Dense => add(Part::Dense, 3 * h * spec.intermediate_size as u64),
                MlpKind::Moe => {
                    let r = spec.router.as_ref().expect("validated");
                    add(
                        Part::Dense,
                        r.n_experts as u64 * (h + 1) + 3 * h * mi * spec.n_shared_experts as u64,
                    );
                    add(Part::Routed, r.n_experts as u64 * 3 * h * mi);
                }
            }
        }
        add(Part::Dense, h);
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
            add(Part::Mtp, one * spec.mtp_layers as u64);
        }
        add(Part::Embedding, spec.vocab_size as u64 * h);
        if !spec.tie_word_embeddings {
            add(Part::Head, spec.vocab_size as u64 * h);
        }
        for (p, n) in a.params.clone() {
            a.bytes.insert(p, (n as f64 * bytes_per_param) as u64);
        }
        a.finish(spec);
        a
    }

    fn finish(&mut self, spec: &ModelSpec) {
        let get = |m: &BTreeMap<Part, u64>, p| m.get(&p).copied().unwrap_or(0);
        let frac = spec
            .router
            .as_ref()
            .map_or(0.0, |r| r.top_k as f64 / r.n_experts as f64);
        let row = |m: &BTreeMap<Part, u64>| get(m, Part::Embedding) / spec.vocab_size as u64;
        self.active_bytes_per_token = get(&self.bytes, Part::Dense)
            + get(&self.bytes, Part::Head)
            + row(&self.bytes)
            + (get(&self.bytes, Part::Routed) as f64 * frac) as u64;
        self.active_params_per_token = get(&self.params, Part::Dense)
            + get(&self.params, Part::Head)
            + row(&self.params)
            + (get(&self.params, Part::Routed) as f64 * frac) as u64;
    }

    pub fn total_params(&self) -> u64 {
        self.params.values().sum()
    }
}
