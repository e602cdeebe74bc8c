//! Qwen3-MoE (`qwen3_moe`): GQA attention with per-head q/k RMSNorm, half-split RoPE, softmax
//! top-k router with `norm_topk_prob`, no shared expert.
//! Reference: `transformers/models/qwen3_moe/{configuration,modeling}_qwen3_moe.py`.

use std::path::Path;

use serde::Deserialize;

use super::glm_moe_dsa::check_act;
use crate::config::{
    parse_arch, token_ids, Arch, AttentionSpec, GqaSpec, LayerSpec, MlpKind, ModelSpec, RopeParams,
    RouterSpec, Scoring,
};
use crate::error::LoadError;

fn d_vocab() -> usize {
    151936
}
fn d_hidden() -> usize {
    2048
}
fn d_inter() -> usize {
    6144
}
fn d_moe_inter() -> usize {
    768
}
fn d_layers() -> usize {
    24
}
fn d_heads() -> usize {
    32
}
fn d_kv() -> usize {
    4
}
fn d_one() -> usize {
    1
}
fn d_experts() -> usize {
    128
}
fn d_topk() -> usize {
    8
}
fn d_max_pos() -> usize {
    32768
}
fn d_eps() -> f32 {
    1e-6
}

/// `Qwen3MoeConfig`, field for field.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_moe_inter")]
    pub moe_intermediate_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_kv")]
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "d_experts", alias = "num_local_experts")]
    pub num_experts: usize,
    #[serde(default = "d_topk")]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "d_one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub use_sliding_window: bool,
}

pub(crate) fn spec(v: serde_json::Value, path: &Path) -> Result<ModelSpec, LoadError> {
    let rope = RopeParams::from_config(&v, path)?;
    let bos = token_ids(v.get("bos_token_id")).first().copied();
    let eos = token_ids(v.get("eos_token_id"));
    let c: Config = parse_arch(v, path)?;
    check_act(&c.hidden_act, path)?;
    if c.use_sliding_window {
        return Err(LoadError::config(
            path,
            "use_sliding_window = true is not supported",
        ));
    }
    if c.num_attention_heads == 0 || c.num_hidden_layers > crate::config::limits::MAX_LAYERS {
        return Err(LoadError::config(
            path,
            "num_attention_heads must be positive and num_hidden_layers <= 1024",
        ));
    }
    let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads);
    let step = c.decoder_sparse_step.max(1);
    let layers = (0..c.num_hidden_layers)
        .map(|i| {
            let moe = !c.mlp_only_layers.contains(&i) && c.num_experts > 0 && (i + 1) % step == 0;
            LayerSpec {
                mlp: if moe { MlpKind::Moe } else { MlpKind::Dense },
                indexer: None,
            }
        })
        .collect();
    Ok(ModelSpec {
        arch: Arch::Qwen3Moe,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        rms_norm_eps: c.rms_norm_eps,
        intermediate_size: c.intermediate_size,
        moe_intermediate_size: c.moe_intermediate_size,
        n_shared_experts: 0,
        attention: AttentionSpec::Gqa(GqaSpec {
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim,
            qk_norm: true,
            bias: c.attention_bias,
        }),
        softmax_scale: (head_dim as f32).powf(-0.5),
        rope: rope.build(head_dim, false, c.max_position_embeddings, path)?,
        dsa: None,
        router: Some(RouterSpec {
            scoring: Scoring::Softmax,
            n_experts: c.num_experts,
            top_k: c.num_experts_per_tok,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: c.norm_topk_prob,
            routed_scaling_factor: 1.0,
            correction_bias: false,
        }),
        layers,
        tie_word_embeddings: c.tie_word_embeddings,
        mtp_layers: 0,
        max_position_embeddings: c.max_position_embeddings,
        bos_token_id: bos,
        eos_token_ids: eos,
    })
}
