//! Architecture-independent description of a model ([`ModelSpec`]), built from `config.json` by
//! the per-architecture modules in `crate::arch`. The forward pass reads only this: architecture
//! differences are data (which attention, which router, which layer schedule), not code paths.

use std::path::Path;

use serde::Deserialize;

use crate::error::LoadError;

/// Which Hugging Face architecture a config describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `glm_moe_dsa`: GLM-5.x (MLA + DSA sparse attention + sigmoid router).
    GlmMoeDsa,
    /// `deepseek_v3`: DeepSeek-V3/R1, Kimi-K2 (MLA + sigmoid router).
    DeepseekV3,
    /// `qwen3_moe`: Qwen3-MoE (GQA + softmax router).
    Qwen3Moe,
}

impl Arch {
    /// The `model_type` spelling.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::GlmMoeDsa => "glm_moe_dsa",
            Self::DeepseekV3 => "deepseek_v3",
            Self::Qwen3Moe => "qwen3_moe",
        }
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3, GLM-5).
#[derive(Debug, Clone, PartialEq)]
pub struct MlaSpec {
    pub n_heads: usize,
    /// `None`: queries come from one `q_proj` (DeepSeek-V2-Lite style).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

impl MlaSpec {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Floats cached per token per layer: the latent plus the shared rope key.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// Grouped-query attention with optional per-head q/k RMSNorm (Qwen3).
#[derive(Debug, Clone, PartialEq)]
pub struct GqaSpec {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub qk_norm: bool,
    pub bias: bool,
}

/// The attention block of every layer.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionSpec {
    Mla(MlaSpec),
    Gqa(GqaSpec),
}

/// Rotary position embedding, with the frequencies already computed (default or YaRN).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// Rotated dimensions per head.
    pub dim: usize,
    /// `dim / 2` inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f32,
    /// DeepSeek/GLM interleaved pairs `(x0,x1),(x2,x3)..` rather than halves `(x_i, x_{i+d/2})`.
    pub interleaved: bool,
}

/// DSA lightning indexer (GLM-5 / DeepSeek-V3.2 sparse attention).
#[derive(Debug, Clone, PartialEq)]
pub struct DsaSpec {
    pub n_heads: usize,
    pub head_dim: usize,
    /// Keys each query attends to.
    pub topk: usize,
    /// Leading rotated dimensions of each indexer head.
    pub rope_dim: usize,
}

/// How router logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// sigmoid, choice by score + `e_score_correction_bias` (DeepSeek-V3 noaux_tc).
    Sigmoid,
    /// softmax over all experts (Qwen3-MoE, Mixtral).
    Softmax,
}

/// The routing rule of MoE layers: pure data for [`crate::routing::route`].
#[derive(Debug, Clone, PartialEq)]
pub struct RouterSpec {
    pub scoring: Scoring,
    pub n_experts: usize,
    pub top_k: usize,
    /// Experts are split into `n_group` groups; only the best `topk_group` groups compete.
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    /// Whether the checkpoint carries `e_score_correction_bias`.
    pub correction_bias: bool,
}

/// Feed-forward kind of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    Dense,
    Moe,
}

/// DSA indexer role of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexerKind {
    /// Runs its own indexer.
    Full,
    /// Reuses the previous full layer's selection.
    Shared,
}

/// Per-layer schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub mlp: MlpKind,
    /// `None` for models without DSA.
    pub indexer: Option<IndexerKind>,
}

/// Everything the forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub rms_norm_eps: f32,
    /// Width of dense-layer MLPs.
    pub intermediate_size: usize,
    /// Width of one routed expert.
    pub moe_intermediate_size: usize,
    /// Shared experts fused into one MLP of width `moe_intermediate_size * n_shared_experts`.
    pub n_shared_experts: usize,
    pub attention: AttentionSpec,
    /// Softmax scale of the main attention (YaRN mscale included).
    pub softmax_scale: f32,
    pub rope: RopeSpec,
    pub dsa: Option<DsaSpec>,
    pub router: Option<RouterSpec>,
    pub layers: Vec<LayerSpec>,
    pub tie_word_embeddings: bool,
    /// Multi-token-prediction layers stored after the main layers (`num_nextn_predict_layers`).
    pub mtp_layers: usize,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// Limits beyond which a config is refused as absurd (far above any released model).
pub mod limits {
    pub const MAX_VOCAB: usize = 1 << 22;
    pub const MAX_HIDDEN: usize = 1 << 16;
    pub const MAX_LAYERS: usize = 1024;
    pub const MAX_HEADS: usize = 1024;
    pub const MAX_HEAD_DIM: usize = 4096;
    pub const MAX_EXPERTS: usize = 1 << 14;
    pub const MAX_INTERMEDIATE: usize = 1 << 18;
    pub const MAX_LORA: usize = 1 << 16;
}

impl ModelSpec {
    /// Refuses zero and absurd dimensions, and inconsistent routing.
    pub fn validate(&self, path: &Path) -> Result<(), LoadError> {
        use limits::*;
        let bad = |r: String| Err(LoadError::config(path, r));
        let check = |name: &str, v: usize, max: usize| -> Result<(), LoadError> {
            if v == 0 || v > max {
                Err(LoadError::config(
                    path,
                    format!("{name} = {v} is outside 1..={max}"),
                ))
            } else {
                Ok(())
            }
        };
        check("vocab_size", self.vocab_size, MAX_VOCAB)?;
        check("hidden_size", self.hidden_size, MAX_HIDDEN)?;
        check("num_hidden_layers", self.layers.len(), MAX_LAYERS)?;
        check(
            "intermediate_size",
            self.intermediate_size,
            MAX_INTERMEDIATE,
        )?;
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps = {} must be positive",
                self.rms_norm_eps
            ));
        }
        match &self.attention {
            AttentionSpec::Mla(m) => {
                check("num_attention_heads", m.n_heads, MAX_HEADS)?;
                check("kv_lora_rank", m.kv_lora_rank, MAX_LORA)?;
                if let Some(q) = m.q_lora_rank {
                    check("q_lora_rank", q, MAX_LORA)?;
                }
                check("qk_nope_head_dim", m.qk_nope_head_dim, MAX_HEAD_DIM)?;
                check("qk_rope_head_dim", m.qk_rope_head_dim, MAX_HEAD_DIM)?;
                check("v_head_dim", m.v_head_dim, MAX_HEAD_DIM)?;
                if m.qk_rope_head_dim % 2 != 0 {
                    return bad("qk_rope_head_dim must be even".into());
                }
            }
            AttentionSpec::Gqa(g) => {
                check("num_attention_heads", g.n_heads, MAX_HEADS)?;
                check("num_key_value_heads", g.n_kv_heads, MAX_HEADS)?;
                check("head_dim", g.head_dim, MAX_HEAD_DIM)?;
                if g.n_heads % g.n_kv_heads != 0 {
                    return bad(format!(
                        "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                        g.n_heads, g.n_kv_heads
                    ));
                }
                if g.head_dim % 2 != 0 {
                    return bad("head_dim must be even".into());
                }
            }
        }
        if let Some(d) = &self.dsa {
            check("index_n_heads", d.n_heads, MAX_HEADS)?;
            check("index_head_dim", d.head_dim, MAX_HEAD_DIM)?;
            check("index_topk", d.topk, 1 << 24)?;
            if d.rope_dim > d.head_dim {
                return bad("qk_rope_head_dim exceeds index_head_dim".into());
            }
            if self.layers.first().and_then(|l| l.indexer) == Some(IndexerKind::Shared) {
                return bad(
                    "indexer_types[0] is `shared` but no earlier layer runs an indexer".into(),
                );
            }
        }
        if let Some(r) = &self.router {
            check("n_routed_experts", r.n_experts, MAX_EXPERTS)?;
            check(
                "moe_intermediate_size",
                self.moe_intermediate_size,
                MAX_INTERMEDIATE,
            )?;
            check("num_experts_per_tok", r.top_k, r.n_experts)?;
            check("n_group", r.n_group, r.n_experts)?;
            check("topk_group", r.topk_group, r.n_group)?;
            if r.n_experts % r.n_group != 0 {
                return bad(format!(
                    "n_routed_experts {} is not a multiple of n_group {}",
                    r.n_experts, r.n_group
                ));
            }
            if r.scoring == Scoring::Sigmoid && r.n_experts / r.n_group < 2 && r.n_group > 1 {
                return bad("group-limited routing needs at least 2 experts per group".into());
            }
            if r.topk_group * (r.n_experts / r.n_group) < r.top_k {
                return bad(format!(
                    "topk_group {} groups of {} experts cannot supply num_experts_per_tok {}",
                    r.topk_group,
                    r.n_experts / r.n_group,
                    r.top_k
                ));
            }
            if !r.routed_scaling_factor.is_finite() {
                return bad("routed_scaling_factor is not finite".into());
            }
        } else if self.layers.iter().any(|l| l.mlp == MlpKind::Moe) {
            return bad("MoE layers without a router".into());
        }
        if self.rope.inv_freq.iter().any(|f| !f.is_finite()) {
            return bad("rope parameters give non-finite frequencies".into());
        }
        if self.mtp_layers > 16 {
            return bad(format!(
                "num_nextn_predict_layers = {} is absurd",
                self.mtp_layers
            ));
        }
        Ok(())
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.mlp == MlpKind::Moe).count()
    }
}

/// `rope_parameters` (transformers >= 5) or the older `rope_theta` + `rope_scaling`.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RopeParams {
    #[serde(default)]
    pub rope_type: Option<String>,
    #[serde(default, alias = "type")]
    pub legacy_type: Option<String>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<f64>,
    #[serde(default)]
    pub beta_fast: Option<f64>,
    #[serde(default)]
    pub beta_slow: Option<f64>,
    #[serde(default)]
    pub mscale: Option<f64>,
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
    #[serde(default)]
    pub attention_factor: Option<f64>,
    #[serde(default)]
    pub truncate: Option<bool>,
}

impl RopeParams {
    /// Reads `rope_parameters`, falling back to `rope_scaling` + top-level `rope_theta`.
    pub fn from_config(v: &serde_json::Value, path: &Path) -> Result<Self, LoadError> {
        let raw = v
            .get("rope_parameters")
            .filter(|x| !x.is_null())
            .or_else(|| v.get("rope_scaling").filter(|x| !x.is_null()));
        let mut p: RopeParams = match raw {
            Some(r) => serde_json::from_value(r.clone())
                .map_err(|e| LoadError::config(path, format!("invalid rope parameters: {e}")))?,
            None => RopeParams::default(),
        };
        if p.rope_theta.is_none() {
            p.rope_theta = v.get("rope_theta").and_then(|t| t.as_f64());
        }
        if p.rope_type.is_none() {
            p.rope_type = p.legacy_type.clone();
        }
        Ok(p)
    }

    fn kind(&self) -> &str {
        self.rope_type.as_deref().unwrap_or("default")
    }

    /// YaRN's `mscale * mscale` correction of the softmax scale (DeepSeek-V3 `yarn_apply_mscale`).
    pub fn softmax_mscale(&self) -> f32 {
        if self.kind() == "default" {
            return 1.0;
        }
        match (self.mscale_all_dim, self.factor) {
            (Some(m), Some(f)) if m != 0.0 => {
                let s = yarn_get_mscale(f, m);
                (s * s) as f32
            }
            _ => 1.0,
        }
    }

    /// Frequencies for `dim` rotated dimensions (`default` or `yarn`).
    pub fn build(
        &self,
        dim: usize,
        interleaved: bool,
        max_pos: usize,
        path: &Path,
    ) -> Result<RopeSpec, LoadError> {
        // (before anything is sized by it: an absurd dimension from a hostile config.json would
        // otherwise ask for terabytes)
        if dim > limits::MAX_HEAD_DIM {
            return Err(LoadError::config(
                path,
                format!(
                    "the rotary dimension {dim} is outside 1..={}",
                    limits::MAX_HEAD_DIM
                ),
            ));
        }
        let base = self.rope_theta.unwrap_or(10000.0);
        if !(base.is_finite() && base > 1.0) {
            return Err(LoadError::config(
                path,
                format!("rope_theta = {base} must be > 1"),
            ));
        }
        // torch computes `base ** (arange(0, dim, 2) / dim)` in float32.
        let pos_freq: Vec<f32> = (0..dim / 2)
            .map(|i| (base as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        match self.kind() {
            "default" => Ok(RopeSpec {
                dim,
                inv_freq: pos_freq.iter().map(|p| 1.0 / p).collect(),
                attention_factor: 1.0,
                interleaved,
            }),
            "yarn" => {
                let orig = self.original_max_position_embeddings.ok_or_else(|| {
                    LoadError::config(path, "yarn needs original_max_position_embeddings")
                })?;
                let factor = self.factor.unwrap_or(max_pos as f64 / orig);
                if !(factor.is_finite() && factor > 0.0 && orig > 0.0) {
                    return Err(LoadError::config(path, "invalid yarn factor"));
                }
                let attention_factor = match self.attention_factor {
                    Some(a) => a,
                    None => match (self.mscale, self.mscale_all_dim) {
                        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                            yarn_get_mscale(factor, m) / yarn_get_mscale(factor, a)
                        }
                        _ => yarn_get_mscale(factor, 1.0),
                    },
                };
                let beta_fast = self.beta_fast.filter(|b| *b != 0.0).unwrap_or(32.0);
                let beta_slow = self.beta_slow.filter(|b| *b != 0.0).unwrap_or(1.0);
                let corr = |rot: f64| {
                    (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
                if self.truncate.unwrap_or(true) {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim as f64 - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let inv_freq = (0..dim / 2)
                    .map(|i| {
                        let ramp =
                            ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let extra = 1.0 - ramp;
                        let p = pos_freq[i];
                        let interp = 1.0 / (factor as f32 * p);
                        let extrap = 1.0 / p;
                        interp * (1.0 - extra) + extrap * extra
                    })
                    .collect();
                Ok(RopeSpec {
                    dim,
                    inv_freq,
                    attention_factor: attention_factor as f32,
                    interleaved,
                })
            }
            other => Err(LoadError::config(
                path,
                format!("unsupported rope_type `{other}` (charm implements default and yarn)"),
            )),
        }
    }
}

fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// `eos_token_id` may be an int, a list, or null.
pub fn token_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// Deserializes an architecture config, naming the file on failure.
pub fn parse_arch<T: serde::de::DeserializeOwned>(
    v: serde_json::Value,
    path: &Path,
) -> Result<T, LoadError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        LoadError::config(
            path,
            format!("invalid config field `{}`: {}", e.path(), e.inner()),
        )
    })
}
